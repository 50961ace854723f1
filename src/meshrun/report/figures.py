"""The report's figures: matplotlib on the Agg backend (no display, no network), one PNG each.

Every function takes the analysed runs and returns PNG bytes, or None when the runs hold
nothing to draw (e.g. no per-rank records in a one-process run).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from meshrun.report.analysis import PARTS, ReportError, RunFigures, Scaling

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "breakdown_png",
    "goodput_png",
    "loss_png",
    "memory_png",
    "ranks_png",
    "require_matplotlib",
    "scaling_png",
    "throughput_png",
]

COLORS = {
    "data_wait_s": "#d62728",
    "forward_s": "#1f77b4",
    "backward_s": "#2ca02c",
    "sync_s": "#9467bd",
    "optimizer_s": "#ff7f0e",
    "loop_s": "#8c564b",
    "other": "#c7c7c7",
}


def require_matplotlib() -> None:
    """Select the Agg backend, or say how to install matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise ReportError(
            "meshrun report draws its figures with matplotlib, which is not installed: "
            "pip install 'meshrun[report]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg", force=True)  # files only: never a window, never a display


def _figure(width: float = 8.0, height: float = 3.6) -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _series(run: RunFigures, key: str) -> tuple[list[int], list[float]]:
    pairs = [
        (int(r["step"]), float(r[key]))
        for r in run.data.rows
        if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _label(run: RunFigures, many: bool) -> str:
    return f"{run.data.name} ({run.world_size} proc)" if many else run.data.name


def loss_png(runs: Sequence[RunFigures]) -> bytes | None:
    fig, ax = _figure()
    for run in runs:
        steps, loss = _series(run, "loss")
        ax.plot(steps, loss, label=_label(run, len(runs) > 1), linewidth=1.2)
        for e in run.nonfinite:
            ax.axvline(int(e["step"]), color="#d62728", linestyle=":", linewidth=1)
        for s in run.data.sessions[1:]:
            if s.rows:
                ax.axvline(int(s.rows[0]["step"]), color="#7f7f7f", linestyle="--", linewidth=1)
        _mark_ft(ax, run)
    ax.set(xlabel="optimizer step", ylabel="loss (global batch mean)", title="Loss")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _png(fig)


# Replica-group events on the loss curve: (colour, line style, legend label).
_FT_MARKS = {
    "left": ("#d62728", "-.", "a replica group left"),
    "joined": ("#2ca02c", "-.", "a replica group joined"),
    "ft_heal": ("#17becf", "-", "healed from a peer"),
    "ft_uncommitted": ("#ff7f0e", ":", "step not committed"),
}


def _mark_ft(ax: Axes, run: RunFigures) -> None:
    """Vertical lines at replica-group events, each kind labelled once in the legend."""
    labelled: set[str] = set()
    for e in run.ft_events:
        kind = str(e.get("change", "")) if e["event"] == "ft_groups" else str(e["event"])
        if kind not in _FT_MARKS:
            continue
        color, style, label = _FT_MARKS[kind]
        # A heal comes at the step its group joins: a wide pale band keeps both lines visible.
        width, alpha = (5.0, 0.35) if kind == "ft_heal" else (1.2, 1.0)
        ax.axvline(
            int(e["step"]),
            color=color,
            linestyle=style,
            linewidth=width,
            alpha=alpha,
            label=label if kind not in labelled else None,
        )
        labelled.add(kind)


def throughput_png(runs: Sequence[RunFigures]) -> bytes | None:
    fig, ax = _figure()
    for run in runs:
        steps, tps = _series(run, "tokens_per_s")
        ax.plot(steps, tps, label=_label(run, len(runs) > 1), linewidth=1.2)
    ax.set(xlabel="optimizer step", ylabel="tokens/s (all ranks)", title="Throughput")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _png(fig)


def breakdown_png(run: RunFigures) -> bytes | None:
    """Stacked per-step breakdown on the main rank; ``other`` is what the parts do not cover."""
    rows = [r for r in run.data.rows if all(isinstance(r.get(p), (int, float)) for p in PARTS)]
    if not rows:
        return None
    steps = [int(r["step"]) for r in rows]
    stacks = {p: [float(r[p]) * 1e3 for r in rows] for p in PARTS}
    stacks["other"] = [
        max(float(r["step_time_s"]) * 1e3 - sum(stacks[p][i] for p in PARTS), 0.0)
        for i, r in enumerate(rows)
    ]
    fig, ax = _figure()
    labels = [k.removesuffix("_s").replace("_", " ") for k in stacks]
    ax.stackplot(
        steps, *stacks.values(), labels=labels, colors=[COLORS[k] for k in stacks], step="mid"
    )
    ax.set(xlabel="optimizer step", ylabel="ms per step (rank 0)", title="Step-time breakdown")
    ax.legend(fontsize="small", loc="upper right", ncol=4)
    ax.grid(alpha=0.3)
    return _png(fig)


def ranks_png(run: RunFigures) -> bytes | None:
    """Heat maps ranks x check windows of each rank's own time (data + forward + optimizer,
    where a rank does not wait for its peers) and its data wait; stragglers marked."""
    windows = run.data.events("ranks")
    if not windows:
        return None
    from matplotlib.figure import Figure

    n = max(len(w["ranks"]) for w in windows)
    fig = Figure(figsize=(8.0, 1.6 + 0.5 * n), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, key, title in (
        (axes[0], "own_s", "own time (ms/step)"),
        (axes[1], "data_wait_s", "data wait (ms/step)"),
    ):
        grid = [[_rank_value(w, rank, key) for w in windows] for rank in range(n)]
        image = ax.imshow(grid, aspect="auto", cmap="magma", interpolation="nearest")
        fig.colorbar(image, ax=ax, shrink=0.9)
        ax.set(title=title, xlabel="check at step")
        ticks = list(range(len(windows)))
        ax.set_xticks(ticks, [str(w["step"]) for w in windows], fontsize="small")
        ax.set_yticks(list(range(n)), [f"rank {r}" for r in range(n)], fontsize="small")
        _mark_stragglers(ax, run, windows, key)
    return _png(fig)


def _rank_value(window: dict[str, Any], rank: int, key: str) -> float:
    rows = [r for r in window["ranks"] if int(r["rank"]) == rank]
    return float(rows[0][key]) * 1e3 if rows else math.nan


def _mark_stragglers(ax: Axes, run: RunFigures, windows: list[dict[str, Any]], key: str) -> None:
    index = {int(w["step"]): i for i, w in enumerate(windows)}
    for s in run.stragglers:
        if s.get("component") == key and int(s["step"]) in index:
            ax.scatter([index[int(s["step"])]], [int(s["rank"])], marker="x", s=60, color="cyan")


def memory_png(run: RunFigures) -> bytes | None:
    keys = sorted({k for r in run.data.rows for k in r if k.startswith("mem_")})
    if not keys:
        return None
    fig, ax = _figure()
    for key in keys:
        steps, values = _series(run, key)
        ax.plot(steps, values, label=key, linewidth=1.2)
    ax.set(xlabel="optimizer step", ylabel="MiB (rank 0)", title="Memory")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _png(fig)


def goodput_png(run: RunFigures) -> bytes | None:
    parts = run.goodput.parts()
    if run.goodput.wall_s <= 0:
        return None
    fig, ax = _figure(8.0, 2.4)
    left = 0.0
    palette = [
        *("#2ca02c", "#ff7f0e", "#1f77b4", "#d62728", "#17becf"),
        *("#9467bd", "#c7c7c7", "#e377c2"),
    ]
    for (name, seconds), color in zip(parts.items(), palette[: len(parts)], strict=True):
        ax.barh([0], [seconds], left=left, color=color, label=f"{name} {seconds:.1f} s")
        left += seconds
    ax.set(xlabel="wall seconds", yticks=[], title=f"Goodput {run.goodput.share:.0%}")
    fig.legend(fontsize="x-small", ncol=3, loc="outside lower center")
    return _png(fig)


def scaling_png(result: Scaling) -> bytes | None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 3.4), dpi=100, layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    sizes = [r.world_size for r in result.rows]
    base = result.rows[0]
    ax1.plot(sizes, [r.samples_per_s for r in result.rows], "o-", label="measured")
    ax1.plot(sizes, [base.samples_per_s * s / base.world_size for s in sizes], "--", label="ideal")
    ax1.set(xlabel="processes", ylabel="samples/s", title=f"Throughput ({result.kind} scaling)")
    ax1.legend(fontsize="small")
    ax2.plot(sizes, [100 * r.efficiency for r in result.rows], "o-")
    ax2.axhline(100, color="#7f7f7f", linestyle="--", linewidth=1)
    ax2.set(xlabel="processes", ylabel="efficiency %", title="Scaling efficiency")
    ax2.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        ax.set_xticks(sizes)
        ax.grid(alpha=0.3)
    return _png(fig)
