"""``meshrun plan --plot FILE.png``: the candidates' memory against step time, and the best
layout's predicted throughput and scaling efficiency against the number of nodes.

matplotlib (the ``plot`` / ``report`` extra) is imported only here, on the Agg backend: a file,
never a window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from meshrun.plan.cost import GB, Cluster, Model, Recompute, Training
from meshrun.plan.errors import PlanError
from meshrun.plan.search import Plan, search

if TYPE_CHECKING:
    from matplotlib.axes import Axes


@dataclass(frozen=True)
class ScalePoint:
    """The best fitting layout at one cluster size (``tokens_per_s`` 0: nothing fits)."""

    nodes: int
    gpus: int
    tokens_per_s: float
    efficiency: float  # tokens/s per GPU relative to the smallest size where a layout fits


def node_counts(nodes: int) -> list[int]:
    """1, 2, 4, ... up to ``nodes``, and ``nodes`` itself."""
    counts, n = [], 1
    while n < nodes:
        counts.append(n)
        n *= 2
    return [*counts, nodes]


def scaling(
    m: Model, t: Training, c: Cluster, micro: Sequence[int], recompute: Sequence[Recompute]
) -> list[ScalePoint]:
    """Search again at each node count (same global batch); sizes the batch does not divide are
    left out."""
    found: list[tuple[int, int, float]] = []
    for nodes in node_counts(c.nodes):
        bigger = replace(c, nodes=nodes)
        try:
            plan = search(m, t, bigger, micro, recompute)
        except PlanError:
            continue
        best = plan.fitting[0].tokens_per_s if plan.fitting else 0.0
        found.append((nodes, bigger.world, best))
    base = next(((g, tps) for _, g, tps in found if tps > 0), None)
    return [
        ScalePoint(n, g, tps, tps / g / (base[1] / base[0]) if base and tps else 0.0)
        for n, g, tps in found
    ]


def check_plottable(plan: Plan) -> None:
    """A bare parameter count has no step time to draw."""
    if not plan.estimates or plan.estimates[0].time is None:
        raise PlanError(
            "--plot draws step times: give a model shape (--layers ...) or --model, not --params"
        )


def plot_plan(path: str, plan: Plan, c: Cluster, points: Sequence[ScalePoint]) -> None:
    """Write the two-panel PNG (see the module docstring)."""
    check_plottable(plan)
    try:
        import matplotlib
    except ImportError:
        raise PlanError(
            "--plot needs matplotlib: pip install 'meshrun[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), dpi=100, layout="constrained")
    left, right = fig.subplots(1, 2)
    _candidates(left, plan, c)
    _scaling(right, points)
    fig.savefig(path, format="png")


def _candidates(ax: Axes, plan: Plan, c: Cluster) -> None:
    fits = [e for e in plan.estimates if e.fits and e.time is not None]
    over = [e for e in plan.estimates if not e.fits and e.time is not None]
    groups: list[tuple[list[Any], str, str, str]] = [
        (over, "x", "#bbbbbb", "does not fit"),
        (fits, "o", "#1f77b4", "fits"),
    ]
    for group, marker, color, label in groups:
        if group:
            ax.scatter(
                [e.time.total for e in group],
                [e.memory.total / GB for e in group],
                s=12,
                marker=marker,
                color=color,
                label=label,
            )
    ax.axhline(c.memory_bytes / GB, color="#d62728", lw=1, label="GPU memory")
    if fits:
        best = fits[0]
        lay, step = best.layout, best.time.total if best.time else 0.0
        ax.scatter(
            [step],
            [best.memory.total / GB],
            marker="*",
            s=160,
            color="#ff7f0e",
            zorder=3,
            label=f"best: dp {lay.dp} x tp {lay.tp} x pp "
            f"{lay.pp}, zero {lay.zero}, mb {lay.micro_batch}, ac "
            f"{lay.activation_checkpointing}",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")  # the layouts that do not fit reach far above the GPU's memory
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("memory per GPU (GB)")
    ax.set_title(f"{len(plan.estimates)} layouts on {c.world} GPUs")
    ax.legend(fontsize=7, loc="best")


def _scaling(ax: Axes, points: Sequence[ScalePoint]) -> None:
    shown = [p for p in points if p.tokens_per_s > 0]
    nodes = [p.nodes for p in shown]
    ax.plot(
        nodes,
        [p.tokens_per_s for p in shown],
        "o-",
        color="#1f77b4",
        label="tokens/s (best layout)",
    )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("predicted tokens/s")
    eff = ax.twinx()
    eff.plot(
        nodes, [p.efficiency for p in shown], "s--", color="#2ca02c", label="scaling efficiency"
    )
    eff.set_ylabel("scaling efficiency (per-GPU tokens/s vs the smallest size)")
    eff.set_ylim(0, max([1.05, *(p.efficiency * 1.05 for p in shown)]))
    ax.set_title("best layout at each size, same global batch")
    lines = ax.get_legend_handles_labels()
    more = eff.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="lower left")
