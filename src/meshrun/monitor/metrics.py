"""Per-step training metrics: a JSON-lines file, a console view and an end-of-run summary.

The logger only receives numbers; it never talks to the process group. Every rank may
build one (so `summary()` works everywhere), but only the main rank writes: exactly one
writer for ``RUN_DIR/metrics.jsonl`` and one for the console.

    with MetricsLogger(run_dir, is_main=rank == 0, log_every=10, total_steps=200) as metrics:
        for step in range(1, 201):
            ...
            metrics.log_step(step, loss=loss.item(), lr=lr, step_time_s=dt,
                             samples=global_batch, tokens=global_batch * seq_len,
                             extra=memory_stats(device))

``tokens=None`` when the run's tokens are not known (images, audio, tabular rows): the lines
then carry samples/s only, never a tokens/s made up from a tensor's shape (docs/monitor.md).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

from meshrun.monitor.metrics_view import (
    PlainView,
    ProgressView,
    Status,
    View,
    may_be_terminal,
    summary_table,
)
from meshrun.monitor.mfu import ModelFlops, constant_per_token
from meshrun.monitor.tensorboard import TensorBoardSink

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["METRICS_FILE", "MetricsLogger"]

METRICS_FILE = "metrics.jsonl"

_log = logging.getLogger(__name__)

# Keys the logger writes itself; `extra` may not overwrite them.
_CORE_KEYS = frozenset(
    {
        "step",
        "time",
        "loss",
        "lr",
        "step_time_s",
        "samples_per_s",
        "tokens_per_s",
        "event",
        "samples_per_s_per_rank",
        "tokens_per_s_per_rank",
        "mfu",
    }
)
# ETA follows the median of this many recent steps: robust to a slow checkpoint step,
# yet quick to follow a real change of speed.
_RECENT_STEPS = 50
# Per-step seconds summed over the steady steps; the summary gives each as a share of the
# step time (``<name>_share``): the loader stall and the exposed/total gradient communication.
_SHARES = ("data_wait_s", "comm_s", "comm_exposed_s")


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.nan


def _float_or_none(value: float | str | None) -> float | None:
    return value if isinstance(value, float) else None


def _json_safe(row: Mapping[str, Any]) -> dict[str, Any]:
    # NaN/Infinity are not JSON; write null so every line parses with any reader.
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


@dataclass
class _Totals:
    """Running totals, kept on every rank; a few bytes per step."""

    steps: int = 0
    samples: int = 0
    tokens: int | None = 0  # None once a step's tokens were not known
    first_samples: int = 0
    first_tokens: int = 0
    first_loss: float = math.nan
    last_loss: float = math.nan
    times: array[float] = field(default_factory=lambda: array("d"))
    mem_peaks: dict[str, float] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)  # _SHARES, steady steps only
    # Step time of the steady steps that carry comm figures (every step under DDP's hook, the
    # sampled ones under the profiler): the comm shares are of those steps.
    comm_time: float = 0.0

    def add(
        self,
        loss: float,
        step_time_s: float,
        samples: int,
        tokens: int | None,
        extra: Mapping[str, float | str],
    ) -> None:
        if self.steps == 0:
            self.first_samples, self.first_tokens = samples, tokens or 0
        # The loop passes NaN on steps skipped by the numerics guard (a caller may also pass NaN
        # for steps it did not measure): first/last loss are the first/last *measured* ones.
        if not math.isnan(loss):
            if math.isnan(self.first_loss):
                self.first_loss = loss
            self.last_loss = loss
        self.steps += 1
        self.samples += samples
        self.tokens = None if tokens is None or self.tokens is None else self.tokens + tokens
        self.times.append(step_time_s)
        if "comm_s" in extra and self.steps > 1:
            self.comm_time += step_time_s
        for key, value in extra.items():
            if isinstance(value, str):  # e.g. comm_method: a label, not a figure
                continue
            if key in _SHARES and self.steps > 1:  # the first step is warm-up (as medians)
                self.sums[key] = self.sums.get(key, 0.0) + value
            if key.startswith("mem_"):
                self.mem_peaks[key] = max(value, self.mem_peaks.get(key, value))

    def steady_times(self) -> Sequence[float]:
        # The first step pays for warm-up (allocator, autotuning, compilation): leave it
        # out of medians once there is anything else to go on.
        return self.times[1:] if len(self.times) > 1 else self.times

    def recent_median(self) -> float:
        steady = self.steady_times()
        return statistics.median(steady[-_RECENT_STEPS:])

    def summary(self) -> dict[str, float]:
        out = {
            "steps": float(self.steps),
            "samples": float(self.samples),
            **({} if self.tokens is None else {"tokens": float(self.tokens)}),
            "total_time_s": math.fsum(self.times),
        }
        if self.steps == 0:
            return out
        steady = self.steady_times()
        median = statistics.median(steady)
        skipped = len(steady) < len(self.times)
        steady_samples = self.samples - (self.first_samples if skipped else 0)
        out |= {
            "step_time_median_s": median,
            "step_time_mean_s": statistics.fmean(steady),
            # Mean work per step over the median step time: one slow step does not
            # drag the throughput figure down.
            "samples_per_s": _rate(steady_samples / len(steady), median),
            "loss_first": self.first_loss,
            "loss_last": self.last_loss,
        }
        if self.tokens is not None:
            steady_tokens = self.tokens - (self.first_tokens if skipped else 0)
            out["tokens_per_s"] = _rate(steady_tokens / len(steady), median)
        steady_time = math.fsum(steady)
        for key, total in self.sums.items():
            over = self.comm_time if key.startswith("comm_") else steady_time
            if over > 0 and len(steady) < len(self.times):
                out[key.removesuffix("_s") + "_share"] = total / over
        if self.mem_peaks:
            out["mem_peak_mb"] = max(self.mem_peaks.values())
            out |= self.mem_peaks
        return out


@dataclass
class _Rates:
    """Per-rank throughput and MFU, derived from the global figures."""

    world_size: int
    flops: ModelFlops | None = None
    peak_flops: float = 0.0  # per rank

    def derived(self, samples_per_s: float, tokens_per_s: float | None) -> dict[str, float]:
        out = {"samples_per_s_per_rank": samples_per_s / self.world_size}
        if tokens_per_s is not None:
            out["tokens_per_s_per_rank"] = tokens_per_s / self.world_size
        model_flops = self.flops.per_second(samples_per_s, tokens_per_s) if self.flops else None
        if model_flops is not None and self.peak_flops:
            out["mfu"] = model_flops / (self.peak_flops * self.world_size)
        return out


def _open_jsonl(path: Path) -> TextIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Append: a resumed run continues the same file. Line buffering: each record reaches
    # the OS as soon as it is written, so a crash loses nothing already logged. The
    # logger owns the handle and closes it in close().
    return open(path, "a", buffering=1, encoding="utf-8")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"MetricsLogger: {name}={value!r}; expected an integer >= 1")


class MetricsLogger:
    """Log one training step at a time; write JSON lines and a console view on the main rank.

    ``step`` is the 1-based optimizer step; ``samples`` and ``tokens`` count the whole
    global step (all ranks). Every call updates running totals on every rank; every
    ``log_every``-th step, and the last one when ``total_steps`` is known, is written.
    Console failures are logged once and disable the console; a failure to write
    ``metrics.jsonl`` raises. ``tensorboard``: the same step lines also as TensorBoard
    scalars under ``RUN_DIR/tensorboard`` (main rank; monitor/tensorboard.py).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        is_main: bool,
        log_every: int = 1,
        total_steps: int | None = None,
        progress: bool = True,
        jsonl: bool = True,
        console: Console | None = None,
        world_size: int = 1,
        tensorboard: bool = False,
    ) -> None:
        _check_positive("log_every", log_every)
        _check_positive("world_size", world_size)
        if total_steps is not None:
            _check_positive("total_steps", total_steps)
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.log_every = log_every
        self.total_steps = total_steps
        self._totals = _Totals()
        self._rates = _Rates(world_size)
        self._closed = False
        self._file: TextIO | None = None
        self._view: View | None = None
        self._tensorboard: TensorBoardSink | None = None
        if is_main:
            if jsonl:
                self._file = _open_jsonl(self.run_dir / METRICS_FILE)
            if tensorboard:
                self._tensorboard = TensorBoardSink(self.run_dir)
            self._view = self._make_view(console, progress)

    def _make_view(self, console: Console | None, progress: bool) -> View:
        # A bar only where someone watches a terminal; logs and pipes get plain lines.
        if console is None:
            if not (progress and may_be_terminal()):
                return PlainView()  # rich only for the summary table, at the end
            from rich.console import Console

            console = Console()
        if progress and console.is_terminal:
            return ProgressView(console, self.total_steps)
        return PlainView(console)

    def log_step(
        self,
        step: int,
        *,
        loss: float,
        lr: float,
        step_time_s: float,
        samples: int,
        tokens: int | None,
        extra: Mapping[str, float | str] | None = None,
    ) -> None:
        """Record one optimizer step (call it on every rank, every step). ``tokens``: None when
        not known (no tokens/s then). ``extra``: more figures for the line; a string value is
        a label (``comm_method``), not summed."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log_step() called after close()")
        extra = extra or {}
        clash = _CORE_KEYS.intersection(extra)
        if clash:
            raise ValueError(f"MetricsLogger: extra keys {sorted(clash)} clash with built-in keys")
        loss, lr, step_time_s = float(loss), float(lr), float(step_time_s)
        self._totals.add(loss, step_time_s, samples, tokens, extra)
        if not self.is_main:
            return
        logged = step % self.log_every == 0 or step == self.total_steps
        samples_per_s = _rate(samples, step_time_s)
        tokens_per_s = None if tokens is None else _rate(tokens, step_time_s)
        if logged and (self._file is not None or self._tensorboard is not None):
            row = {
                "step": step,
                "time": time.time(),
                "loss": loss,
                "lr": lr,
                "step_time_s": step_time_s,
                "samples_per_s": samples_per_s,
                **({} if tokens_per_s is None else {"tokens_per_s": tokens_per_s}),
                **self._rates.derived(samples_per_s, tokens_per_s),
                **extra,
            }
            if self._file is not None:
                self._write(row)
            if self._tensorboard is not None:
                self._tensorboard.add(step, row)
        # The console shows the latest *measured* loss (NaN marks steps that were not logged).
        status = Status(
            *(step, self.total_steps, self._totals.last_loss, lr, step_time_s),
            *(samples_per_s, tokens_per_s, self._eta(step), _float_or_none(extra.get("grad_norm"))),
        )
        self._on_console("progress", lambda view: view.show(status, logged))

    def log_event(self, event: str, **fields: Any) -> None:
        """Append ``{"event": event, "time": ..., **fields}`` to metrics.jsonl (main rank only;
        other ranks and a logger without the file do nothing)."""
        if self._file is not None and not self._closed:
            self._write({"event": event, "time": time.time(), **fields})

    def _eta(self, step: int) -> float | None:
        if self.total_steps is None:
            return None
        return max(self.total_steps - step, 0) * self._totals.recent_median()

    def _write(self, row: Mapping[str, Any]) -> None:
        # Deliberately unguarded: the metrics file is the record the user asked for, so
        # a full disk or a vanished mount must stop the run, not pass unnoticed.
        assert self._file is not None
        self._file.write(json.dumps(_json_safe(row), allow_nan=False) + "\n")
        self._file.flush()

    def _on_console(self, what: str, action: Callable[[View], None]) -> None:
        view = self._view
        if view is None:
            return
        try:
            action(view)
        except Exception:
            # A broken terminal must not end a training run; say so once, then stay quiet.
            self._view = None
            _log.warning(
                "meshrun: console %s output failed; console output is off for this run",
                what,
                exc_info=True,
            )

    def summary(self) -> dict[str, float]:
        """Totals so far: steps, time, median/mean step time, throughput, loss, peak memory.

        Medians and means leave out the first step once there are others (warm-up).
        Memory: ``mem_peak_mb`` is the largest ``mem_*`` figure seen in ``extra``, and
        each ``mem_*`` key holds its own maximum.
        """
        out = self._totals.summary()
        if "samples_per_s" in out:
            out |= self._rates.derived(out["samples_per_s"], out.get("tokens_per_s"))
        return out

    def set_flops_per_token(self, flops_per_token: float, peak_flops_per_rank: float) -> None:
        """Report MFU: model FLOPs per token (forward + backward) x tokens/s over the peak
        FLOP/s of all ranks (``peak_flops_per_rank`` x world size)."""
        if flops_per_token <= 0:
            raise ValueError(f"MetricsLogger: flops_per_token={flops_per_token!r}; must be > 0")
        source = f"{flops_per_token:.3g} per token"
        self.set_flops(constant_per_token(flops_per_token, source), peak_flops_per_rank)

    def set_flops(self, flops: ModelFlops, peak_flops_per_rank: float) -> None:
        """Report MFU: the model's FLOP/s (per sample x samples/s, or per token x tokens/s)
        over the peak FLOP/s of all ranks (``peak_flops_per_rank`` x world size)."""
        if peak_flops_per_rank <= 0 or flops.per_sample < 0:
            raise ValueError(
                f"MetricsLogger: peak_flops_per_rank={peak_flops_per_rank!r}, flops per sample="
                f"{flops.per_sample!r}; the peak must be > 0 and the FLOPs >= 0"
            )
        self._rates.flops = flops
        self._rates.peak_flops = peak_flops_per_rank

    def close(self) -> None:
        """Show the summary table and append the summary record (main rank). Idempotent."""
        if self._closed:
            return
        self._closed = True
        summary = self.summary()
        if self._totals.steps:  # a run closed before training has nothing to summarise
            self._on_console("summary", lambda view: view.finish(summary_table(summary)))
        self._view = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._file is not None:
            try:
                self._write({"event": "summary", "time": time.time(), **summary})
            finally:
                self._file.close()
                self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Runs on errors too: the summary of a crashed run is still worth having.
        self.close()
