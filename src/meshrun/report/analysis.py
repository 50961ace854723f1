"""``meshrun report``: read run directories' ``metrics.jsonl`` and say where the time went.

This module is pure (no process group, no plotting): it loads the records, splits them into
process starts (restarts append to the same file), and derives the figures the report shows:
throughput, the step breakdown, stalls, non-finite skips, checkpoint time, goodput and, given
runs at several world sizes, the scaling efficiency. ``report/html.py`` draws and writes it.

Goodput (where the wall time went, in parts that add up to it) is ``report/goodput.py``.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrun.monitor.metrics import METRICS_FILE
from meshrun.report.goodput import FT_EVENTS, Goodput, goodput
from meshrun.report.records import RunData, Session

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "ReportError",
    "RunData",
    "RunFigures",
    "Scaling",
    "analyse",
    "load_run",
    "scaling",
]

# The step breakdown's parts, in the order they are stacked (monitor/step.py writes them).
PARTS = ("data_wait_s", "forward_s", "backward_s", "sync_s", "optimizer_s", "loop_s")
# A step this many times the median (and 50 ms over it) is a stall worth listing.
STALL_FACTOR = 3.0
STALL_MIN_S = 0.05


class ReportError(ValueError):
    """A run directory that cannot be reported on; the message says why and what to do."""


def load_run(path: str | Path) -> RunData:
    """Read ``RUN_DIR/metrics.jsonl`` (and ``config.toml`` when present)."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise ReportError(
            f"run directory {str(run_dir)!r} does not exist (or is not a directory); pass the "
            "job.run_dir of a finished or running job, e.g. runs/demo"
        )
    metrics = run_dir / METRICS_FILE
    if not metrics.is_file():
        raise ReportError(
            f"{str(run_dir)!r} has no {METRICS_FILE}: is it a meshrun run directory (job.run_dir)? "
            "The file is written by the main rank while training, unless metrics.jsonl = false"
        )
    records, bad = _read_jsonl(metrics)
    sessions = _split_sessions(records)
    if not any(s.rows for s in sessions):
        raise ReportError(
            f"{metrics} holds no training step yet (the job has not finished a step); "
            "report on it once it has"
        )
    return RunData(run_dir, run_dir.resolve().name, sessions, _read_config(run_dir), bad)


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    records: list[dict[str, Any]] = []
    bad = 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            bad += 1  # a line cut short by a crash: the rest of the file is still good
            continue
        if isinstance(value, dict):
            records.append(value)
    return records, bad


def _split_sessions(records: Iterable[dict[str, Any]]) -> list[Session]:
    sessions: list[Session] = []
    last_step = 0
    for rec in records:
        kind = rec.get("event")
        # A new session at each start record; for files written before start records
        # existed, when the step number goes back (a resume from a checkpoint).
        went_back = (
            kind is None and sessions and sessions[-1].start is None and rec["step"] <= last_step
        )
        if kind == "start" or not sessions or went_back:
            sessions.append(Session(rec if kind == "start" else None))
            if kind == "start":
                continue
        if kind is None:
            sessions[-1].rows.append(rec)
            last_step = int(rec["step"])
        else:
            sessions[-1].events.append(rec)
    return sessions


def _read_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.toml"
    if not path.is_file():
        return {}
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError:
        return {}


# --- analysis --------------------------------------------------------------------------------


@dataclass
class Stall:
    step: int
    step_time_s: float
    median_s: float
    cause: str  # "checkpoint after step N", or "" when unknown


@dataclass
class RunFigures:
    """What the report says about one run."""

    data: RunData
    world_size: int
    dp: int
    global_batch: int
    per_rank_batch: float
    steps_done: int  # the last step reached
    median_step_s: float
    samples_per_s: float
    tokens_per_s: float
    mfu: float  # NaN when the run did not record it (no peak FLOP/s known)
    breakdown: dict[str, float]  # per-step means of PARTS and "other"
    restarts: int
    stalls: list[Stall]
    nonfinite: list[dict[str, Any]]
    stragglers: list[dict[str, Any]]
    # The top-k slowest ranks of the last straggler check (moving averages); [] if none.
    slowest: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]
    goodput: Goodput
    notes: list[str]
    # ft_groups / ft_uncommitted / ft_heal events in file order; empty without replica groups.
    ft_events: list[dict[str, Any]] = field(default_factory=list)


def analyse(data: RunData) -> RunFigures:
    """The figures of one run (see the module docstring for the definitions)."""
    rows = data.rows
    steady = _steady_rows(data)
    median = statistics.median(r["step_time_s"] for r in steady)
    world, dp, gb, notes = _shape(data)
    nonfinite = data.events("nonfinite")
    checkpoints = data.events("checkpoint")
    return RunFigures(
        data=data,
        world_size=world,
        dp=dp,
        global_batch=gb,
        per_rank_batch=gb / dp if dp else math.nan,
        steps_done=max(int(r["step"]) for r in rows),
        median_step_s=median,
        samples_per_s=_median_of(steady, "samples_per_s"),
        tokens_per_s=_median_of(steady, "tokens_per_s"),
        mfu=_median_of(steady, "mfu"),
        breakdown=_breakdown(steady),
        restarts=len(data.sessions) - 1,
        stalls=_stalls(data, median),
        nonfinite=nonfinite,
        stragglers=data.events("straggler"),
        slowest=next((e["slowest"] for e in data.events("ranks")[::-1] if e.get("slowest")), []),
        checkpoints=checkpoints,
        goodput=goodput(data),
        notes=notes + _log_every_note(data),
        ft_events=[e for s in data.sessions for e in s.events if e.get("event") in FT_EVENTS],
    )


def _steady_rows(data: RunData) -> list[dict[str, Any]]:
    """Rows without each session's first step (warm-up) and without guard-skipped steps."""
    out = [
        r
        for s in data.sessions
        for i, r in enumerate(s.rows)
        if (i > 0 or len(s.rows) == 1) and r.get("loss") is not None
    ]
    return out or data.rows


def _median_of(rows: Sequence[Mapping[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else math.nan


def _shape(data: RunData) -> tuple[int, int, int, list[str]]:
    """World size, data-parallel size, global batch (from the start record, else guessed)."""
    starts = [s.start for s in data.sessions if s.start is not None]
    notes: list[str] = []
    if starts:
        st = starts[-1]
        return int(st["world_size"]), int(st["dp"]), int(st["global_batch"]), notes
    ranks = data.events("ranks")
    world = len(ranks[-1]["ranks"]) if ranks else 1
    gb = int(data.config.get("data", {}).get("global_batch", 0))
    notes.append(
        f"no start record (written since meshrun 0.1): world size {world} taken from the "
        "per-rank records, data parallelism assumed to span all ranks"
    )
    return world, world, gb, notes


def _breakdown(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per-step means of the breakdown parts; ``other`` = step time the parts do not cover."""
    usable = [r for r in rows if all(isinstance(r.get(p), (int, float)) for p in PARTS)]
    if not usable:
        return {}
    out = {p: statistics.fmean(float(r[p]) for r in usable) for p in PARTS}
    total = statistics.fmean(float(r["step_time_s"]) for r in usable)
    out["other"] = max(total - sum(out.values()), 0.0)
    return out


def _stalls(data: RunData, median: float) -> list[Stall]:
    saved = {int(e["after_step"]) for e in data.events("checkpoint") if "after_step" in e}
    found = []
    for s in data.sessions:
        for r in s.rows[1:]:
            t = float(r["step_time_s"])
            if t >= STALL_FACTOR * median and t - median >= STALL_MIN_S:
                step = int(r["step"])
                cause = f"checkpoint after step {step - 1}" if step - 1 in saved else ""
                found.append(Stall(step, t, median, cause))
    return found


def _log_every_note(data: RunData) -> list[str]:
    every = int(data.config.get("metrics", {}).get("log_every", 1))
    if every <= 1:
        return []
    return [
        f"metrics.log_every = {every}: curves and stalls show every {every}th step only; "
        "step counts and goodput use all steps"
    ]


# --- scaling ---------------------------------------------------------------------------------


@dataclass
class ScalingRow:
    world_size: int
    samples_per_s: float
    speedup: float  # throughput over the smallest run's
    efficiency: float  # (throughput per process) over the smallest run's


@dataclass
class Scaling:
    kind: str  # "strong", "weak" or "mixed"
    explanation: str
    rows: list[ScalingRow]


def scaling(runs: Sequence[RunFigures]) -> Scaling | None:
    """Scaling efficiency across runs of one job at several world sizes (None if fewer than two
    distinct sizes). Strong: the same global batch; weak: the same batch per data-parallel
    rank. In both, efficiency = (samples/s per process) / (that of the smallest run): for
    strong scaling it is speedup / size ratio, for weak scaling the step-time ratio."""
    by_size = {r.world_size: r for r in runs}
    if len(by_size) < 2:
        return None
    ordered = [by_size[k] for k in sorted(by_size)]
    base = ordered[0]
    kind, why = _scaling_kind(ordered)
    rows = []
    for r in ordered:
        speedup = r.samples_per_s / base.samples_per_s
        eff = speedup / (r.world_size / base.world_size)
        rows.append(ScalingRow(r.world_size, r.samples_per_s, speedup, eff))
    return Scaling(kind, why, rows)


def _scaling_kind(ordered: Sequence[RunFigures]) -> tuple[str, str]:
    if len({r.global_batch for r in ordered}) == 1:
        return "strong", (
            f"strong scaling: the global batch is {ordered[0].global_batch} in every run, so more "
            "processes share the same work per step; ideal: throughput grows with the processes"
        )
    if len({r.per_rank_batch for r in ordered}) == 1:
        return "weak", (
            f"weak scaling: every data-parallel rank takes {ordered[0].per_rank_batch:g} samples "
            "per step in every run, so the work grows with the processes; ideal: constant step time"
        )
    return "mixed", (
        "neither the global batch nor the batch per rank is the same across runs: efficiency is "
        "throughput per process relative to the smallest run, not a clean strong/weak figure"
    )
