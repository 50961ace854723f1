"""``meshrun report``: read run directories' ``metrics.jsonl`` and say where the time went.

This module is pure (no process group, no plotting): it loads the records, splits them into
process starts (restarts append to the same file), and derives the figures the report shows:
throughput, the step breakdown, stalls, non-finite skips, checkpoint time, goodput and, given
runs at several world sizes, the scaling efficiency. ``report/html.py`` draws and writes it.

Goodput is the share of wall time spent on useful steps. Wall time runs from the first
``start`` record (written when ``meshrun.init()`` has set up the process group) to the last
record of the file; process start-up before that (imports) is not seen. A useful step is one
whose update is in the final model: not skipped by the numerics guard and not redone after a
restart. Its time is the run's median step time, so everything a step took beyond the median
(stalls, jitter) is counted apart, as are checkpoint saves, restarts and what runs outside
the step loop (start-up after init, evaluation, the final save).

Under replica groups (``[fault_tolerance]``) a step the quorum did not commit is lost work: it
leaves no step line, only an ``ft_uncommitted`` event. Its time runs from the record before
it to that event, and goodput counts it apart (it would otherwise hide in the next step's
time, or outside the loop when no step followed).
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
# The events replica-group fault tolerance writes (ft/replica.py), in the report's table.
FT_EVENTS = ("ft_groups", "ft_uncommitted", "ft_heal")


class ReportError(ValueError):
    """A run directory that cannot be reported on; the message says why and what to do."""


@dataclass
class Session:
    """The records of one process start (the first run, or a restart appending to the file)."""

    start: dict[str, Any] | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]


@dataclass
class RunData:
    """One run directory's records."""

    path: Path
    name: str
    sessions: list[Session]
    config: dict[str, Any]
    skipped_lines: int = 0  # unreadable lines (a crash in the middle of a write)

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [r for s in self.sessions for r in s.rows]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for s in self.sessions for e in s.of(kind)]


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
class Goodput:
    """Where the wall time went (seconds); the parts add up to ``wall_s``."""

    wall_s: float
    useful_s: float
    skipped_s: float  # steps skipped by the numerics guard
    redone_s: float  # steps done again after a restart
    checkpoint_s: float  # training blocked by checkpoint saves
    slow_steps_s: float  # step time beyond the median: stalls and jitter
    outside_s: float  # outside the step loop: after init, restarts, eval, final save
    # Steps the replica-group quorum did not commit; None for a run without replica groups,
    # whose table then reads as it always did.
    uncommitted_s: float | None = None

    @property
    def share(self) -> float:
        return self.useful_s / self.wall_s if self.wall_s > 0 else math.nan

    def parts(self) -> dict[str, float]:
        out = {
            "useful steps": self.useful_s,
            "slow steps (beyond the median)": self.slow_steps_s,
            "checkpoint saves": self.checkpoint_s,
            "non-finite skips": self.skipped_s,
            "redone after restart": self.redone_s,
            "outside the step loop": self.outside_s,
        }
        if self.uncommitted_s is not None:
            out["uncommitted steps (replica groups)"] = self.uncommitted_s
        return out


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
        goodput=_goodput(data, median),
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


def _goodput(data: RunData, median: float) -> Goodput:
    wall = _wall_time(data)
    executed, steps_s, ckpt_in = 0, 0.0, 0.0
    healed_in, healed = _healed_steps(data)
    for s, gap in zip(data.sessions, healed_in, strict=True):
        first, last = _session_steps(s)
        ran = (last - first + 1 if last else 0) - gap
        executed += ran
        steps_s += _session_step_time(s, ran)
        # A save after step S blocks inside step S+1's time; the last one is after the loop.
        ckpt_in += sum(e["blocked_s"] for e in s.of("checkpoint") if e["after_step"] < last)
    # Steps a healed replica group took from a peer are in its model but not its time.
    distinct = max(int(r["step"]) for r in data.rows) - healed
    skipped = len(data.events("nonfinite"))
    ckpt_all = sum(float(e["blocked_s"]) for e in data.events("checkpoint"))
    useful = distinct - skipped
    lost_in, lost_out = _uncommitted_time(data)
    return Goodput(
        wall_s=wall,
        useful_s=useful * median,
        skipped_s=skipped * median,
        redone_s=(executed - distinct) * median,
        checkpoint_s=ckpt_all,
        slow_steps_s=max(steps_s - executed * median - ckpt_in - lost_in, 0.0),
        outside_s=max(wall - steps_s - (ckpt_all - ckpt_in) - lost_out, 0.0),
        uncommitted_s=lost_in + lost_out if _has_replica_groups(data) else None,
    )


def _has_replica_groups(data: RunData) -> bool:
    return any("live_groups" in r for r in data.rows) or any(
        e.get("event") in FT_EVENTS for s in data.sessions for e in s.events
    )


def _healed_steps(data: RunData) -> tuple[list[int], int]:
    """Steps received by ``ft_heal`` rather than run: (per session, those inside its step
    range; all). A restarted group heals before its first step; a live one between steps."""
    inside, total, prev_last = [], 0, 0
    for s in data.sessions:
        gap = 0
        for e in s.of("ft_heal"):
            before = [int(r["step"]) for r in s.rows if float(r["time"]) <= float(e["time"])]
            base = max(before) if before else prev_last
            gap += max(int(e["step"]) - base, 0) if before else 0
            total += max(int(e["step"]) - base, 0)
        inside.append(gap)
        prev_last = max(prev_last, int(s.rows[-1]["step"])) if s.rows else prev_last
    return inside, total


def _uncommitted_time(data: RunData) -> tuple[float, float]:
    """Seconds of uncommitted steps (from the record before each ``ft_uncommitted`` event to
    it): (inside the step time of the next committed step, after a session's last step)."""
    inside = after = 0.0
    for s in data.sessions:
        last_row = float(s.rows[-1]["time"]) if s.rows else -math.inf
        for e in s.of("ft_uncommitted"):
            t = float(e["time"])
            before = [float(r["time"]) for r in [*s.rows, *s.events] if float(r["time"]) < t]
            if s.start is not None:
                before.append(float(s.start["time"]))
            lost = t - max(before) if before else 0.0
            if t < last_row:
                inside += lost
            else:
                after += lost
    return inside, after


def _wall_time(data: RunData) -> float:
    first = data.sessions[0]
    if first.start is not None:
        t0 = float(first.start["time"])
    else:  # no start record: from the beginning of the first logged step
        t0 = float(first.rows[0]["time"]) - float(first.rows[0]["step_time_s"])
    t1 = max(float(r["time"]) for s in data.sessions for r in [*s.rows, *s.events])
    return max(t1 - t0, 0.0)


def _session_steps(s: Session) -> tuple[int, int]:
    """(first, last) optimizer step this session ran; (0, 0) if none. Rows may be every
    ``log_every``-th step only, so the first comes from the resume line or the fresh start."""
    if not s.rows:
        return 0, 0
    last = int(s.rows[-1]["step"])
    resumed = s.of("resume")
    healed = [e for e in s.of("ft_heal") if float(e["time"]) <= float(s.rows[0]["time"])]
    if healed:  # a restarted replica group continues at the step it healed to
        first = int(healed[-1]["step"]) + 1
    elif resumed:
        first = int(resumed[0]["from_step"]) + 1
    elif s.start is not None:
        first = 1  # started without a checkpoint
    else:  # a file without start lines: the first logged step is all we know
        first = int(s.rows[0]["step"])
    return min(first, int(s.rows[0]["step"])), last


def _session_step_time(s: Session, executed: int) -> float:
    """Seconds inside steps: the summary's total when the session ended cleanly, else the
    logged steps' times scaled to the steps executed (rows may be every log_every-th)."""
    summary = s.of("summary")
    if summary and "total_time_s" in summary[-1]:
        return float(summary[-1]["total_time_s"])
    logged = [float(r["step_time_s"]) for r in s.rows]
    return math.fsum(logged) * executed / len(logged) if logged else 0.0


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
