"""The console side of the training metrics: one plain line per logged step (CI logs,
torchrun's prefixes) or a live bar on a terminal, and the end-of-run summary table.

Throughput is shown as tokens/s where the run's tokens are known, else as samples/s
(docs/monitor.md, "Throughput").

rich is imported only where it draws (the live bar, the summary table, a console the caller
passed): plain step lines to a log or a pipe are written without it, so a worker does not
pay rich's import before its first step.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import TaskID
    from rich.table import Table


def may_be_terminal() -> bool:
    """Whether rich could take stdout for a terminal: it is a tty, or rich's own overrides
    (TTY_COMPATIBLE, FORCE_COLOR) are set. False means rich would draw plain lines too."""
    if "TTY_COMPATIBLE" in os.environ or "FORCE_COLOR" in os.environ:
        return True
    isatty = getattr(sys.stdout, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def format_duration(seconds: float) -> str:
    """1:18 or 2:05:09, like a stopwatch."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass(frozen=True)
class Status:
    """What the console shows about the latest step."""

    step: int
    total: int | None
    loss: float
    lr: float
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float | None  # None: the run's tokens are not known
    eta_s: float | None
    grad_norm: float | None = None  # the clip's norm (optim.grad_clip > 0), else None

    def eta(self) -> str:
        return "-" if self.eta_s is None else format_duration(self.eta_s)

    def rate(self) -> str:
        """``12,345 tok/s`` where tokens are known, else ``56.7 samples/s``."""
        if self.tokens_per_s is None:
            return f"{self.samples_per_s:,.1f} samples/s"
        return f"{self.tokens_per_s:,.0f} tok/s"

    def plain_line(self) -> str:
        if self.total is None:
            head = f"step {self.step}"
        else:
            head = f"step {self.step:>{len(str(self.total))}}/{self.total}"
        parts = [
            head,
            f"loss {self.loss:.4f}",
            *([] if self.grad_norm is None else [f"grad_norm {self.grad_norm:.4g}"]),
            f"lr {self.lr:.2e}",
            f"{self.step_time_s:.3f} s/step",
            self.rate(),
        ]
        if self.eta_s is not None:
            parts.append(f"ETA {self.eta()}")
        return " | ".join(parts)


class View(Protocol):
    def show(self, status: Status, logged: bool) -> None: ...

    def finish(self, table: Table) -> None: ...


class PlainView:
    """One line per logged step: readable in CI logs and behind torchrun's prefixes.
    Without a console the lines go straight to stdout (what rich writes there too)."""

    def __init__(self, console: Console | None = None) -> None:
        self._console = console

    def show(self, status: Status, logged: bool) -> None:
        if not logged:
            return
        if self._console is None:
            sys.stdout.write(status.plain_line() + "\n")
            sys.stdout.flush()
        else:
            # soft_wrap: a log line must stay one line, whatever width rich assumes.
            self._console.print(status.plain_line(), markup=False, highlight=False, soft_wrap=True)

    def finish(self, table: Table) -> None:
        if self._console is None:
            from rich.console import Console

            self._console = Console()
        self._console.print(table)


class ProgressView:
    """A live bar for an interactive terminal; updated every step, redrawn by rich's thread."""

    def __init__(self, console: Console, total: int | None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._total = total
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("ETA {task.fields[eta]}"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("lr {task.fields[lr]}"),
            TextColumn("{task.fields[s_per_step]} s/step"),
            TextColumn("{task.fields[rate]}"),
            console=console,
        )
        self._task: TaskID | None = None

    def show(self, status: Status, logged: bool) -> None:
        fields: dict[str, Any] = {
            "eta": status.eta(),
            "loss": f"{status.loss:.4f}",
            "lr": f"{status.lr:.2e}",
            "s_per_step": f"{status.step_time_s:.3f}",
            "rate": status.rate(),
        }
        if self._task is None:
            # Started on the first step, not in __init__, so nothing is drawn before
            # training has begun.
            self._progress.start()
            self._task = self._progress.add_task("train", total=self._total, **fields)
        self._progress.update(self._task, completed=status.step, **fields)

    def finish(self, table: Table) -> None:
        self._progress.stop()
        self._progress.console.print(table)


def summary_table(summary: Mapping[str, float]) -> Table:
    from rich.table import Table

    table = Table(title="training summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    formats: list[tuple[str, str, Callable[[float], str]]] = [
        ("steps", "steps", lambda v: f"{v:,.0f}"),
        ("total_time_s", "total step time", lambda v: f"{format_duration(v)} ({v:,.1f} s)"),
        ("step_time_median_s", "median step time", lambda v: f"{v:.3f} s"),
        ("step_time_mean_s", "mean step time", lambda v: f"{v:.3f} s"),
        ("samples_per_s", "samples/s (median)", lambda v: f"{v:,.1f}"),
        ("tokens_per_s", "tokens/s (median)", lambda v: f"{v:,.0f}"),
        ("samples_per_s_per_rank", "samples/s per rank", lambda v: f"{v:,.1f}"),
        ("tokens_per_s_per_rank", "tokens/s per rank", lambda v: f"{v:,.0f}"),
        ("mfu", "MFU", lambda v: f"{100 * v:.2f}%"),
        ("data_wait_share", "data-loader stall", lambda v: f"{100 * v:.1f}% of step"),
        ("comm_share", "communication", lambda v: f"{100 * v:.1f}% of step"),
        ("comm_exposed_share", "  exposed (not hidden)", lambda v: f"{100 * v:.1f}% of step"),
        ("loss_first", "first loss", lambda v: f"{v:.4f}"),
        ("loss_last", "last loss", lambda v: f"{v:.4f}"),
    ]
    formats.append(("mem_peak_mb", "peak memory", lambda v: f"{v:,.1f} MiB"))
    formats += [
        (k, f"  max {k}", lambda v: f"{v:,.1f}")
        for k in summary
        if k.startswith("mem_") and k != "mem_peak_mb"
    ]
    for key, label, fmt in formats:
        if key in summary:
            table.add_row(label, fmt(summary[key]))
    return table
