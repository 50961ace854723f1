"""Slow links between nodes: when plain data parallel stops paying, and what DiLoCo costs.

For one model on ``nodes`` x ``gpus_per_node`` GPUs, the rows of :func:`link_rows` put the
synchronous layouts (DDP, HSDP, ZeRO-3: every step crosses the inter-node link) next to DiLoCo
with H inner steps (one replica group per node, DDP inside it; every H steps an all-reduce of
the pseudo-gradient between the groups, Douillard et al. 2023, arXiv 2311.08105, Algorithm 1):
the step time, the communication share of it and the scaling efficiency. :func:`recommend`
names DiLoCo when the best synchronous layout falls below an efficiency threshold, with what
the papers say it costs in convergence.

The model (pure, docs/slow_links.md): the synchronous rows are plan/cost.py's ``evaluate``
of that layout; a DiLoCo inner step is the same evaluation on one node with the node's share
of the global batch, and the outer step adds all_reduce(nodes, P x b_outer) / H over the
inter-node link (b_outer: 4 bytes in fp32, 2 in bf16, 1 quantized), not hidden (torchft's
DiLoCo blocks the step that synchronises; streaming fragments move the same bytes in turns).
Scaling efficiency = T_1 / (nodes x T_N): T_1 is DDP's step time for the same global batch
on one node, so 1.0 means the nodes add their full rate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from meshrun.plan.cost import Cluster, Layout, Link, Model, Training, evaluate, group_link
from meshrun.plan.errors import PlanError
from meshrun.plan.memory import state_bytes_per_param

# Bytes per parameter of the outer all-reduce: torchft's DiLoCo sends the fp32 pseudo-
# gradient, or a quantized one (``should_quantize``; INTELLECT-1 used int8).
OUTER_BYTES = {"fp32": 4.0, "bf16": 2.0, "quantized": 1.0}
DEFAULT_THRESHOLD = 0.8  # below 80 %, a fifth of every added node goes to the link
DEFAULT_SYNC_EVERY = (10, 50, 100)


@dataclass(frozen=True)
class LinkRow:
    """One way to train across the nodes: seconds per (inner) optimizer step for the same
    global batch, the exposed communication in it, and the scaling efficiency."""

    name: str
    step_s: float
    comm_s: float
    efficiency: float
    sync_every: int = 1  # H: optimizer steps per synchronisation across the link
    link_bytes: float = 0.0  # bytes each GPU moves in collectives per step (average)

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def diloco(self) -> bool:
        return self.sync_every > 1


def outer_step_s(link: Link, params: float, outer: str = "fp32") -> float:
    """One outer synchronisation: the ring all-reduce of every GPU's pseudo-gradient (the
    whole replica: DDP inside the group) over the inter-node link."""
    return link.all_reduce(params * OUTER_BYTES[outer])


def diloco_step_s(inner_s: float, outer_s: float, sync_every: int) -> float:
    """Seconds per inner step, averaged over a window of H: the inner steps, then the outer
    all-reduce once (Douillard et al. 2023, Algorithm 1)."""
    return inner_s + outer_s / sync_every


def volume_ratio(sync_every: int, dp_bytes: float, outer: str = "fp32") -> float:
    """How many times fewer bytes cross the link than data parallel's per-step gradient
    all-reduce of ``dp_bytes`` per parameter: H x dp_bytes / b_outer."""
    return sync_every * dp_bytes / OUTER_BYTES[outer]


def link_rows(
    m: Model,
    t: Training,
    c: Cluster,
    sync_every: Sequence[int] = DEFAULT_SYNC_EVERY,
    outer: str = "fp32",
    searched: Sequence[tuple[str, Layout]] = (),
) -> list[LinkRow]:
    """DDP, HSDP, ZeRO-3, then ``searched`` (the plan's best layouts, by name: a pipeline
    across the nodes may beat all three) and DiLoCo at each H, for ``m`` on ``c``
    (``c.nodes`` >= 2 for the DiLoCo rows: one replica group per node)."""
    _check(m, t, c, sync_every, outer)
    base = _step(m, Layout(dp_replicate=c.gpus_per_node), t, _one_node(c))[0]
    world, g = c.world, c.gpus_per_node
    layouts = [("DDP", Layout(dp_replicate=world))]
    if c.nodes > 1 and g > 1:
        layouts.append(("HSDP", Layout(dp_replicate=c.nodes, dp_shard=g, zero=3)))
    if world > 1:
        layouts.append(("ZeRO-3", Layout(dp_shard=world, zero=3)))
    grad = m.total_params() * state_bytes_per_param(t)[1]
    # What each GPU moves per step: DDP the gradients; HSDP its shard's, between replicas;
    # ZeRO-3 gathers every micro-batch forward and backward and reduce-scatters once.
    moved = {"DDP": grad, "HSDP": grad / g, "ZeRO-3": grad * (2 * t.global_batch // world + 1)}
    rows = []
    for name, lay in [*layouts, *searched]:
        step, comm = _step(m, lay, t, c)
        rows.append(LinkRow(name, step, comm, base / (c.nodes * step), 1, moved.get(name, 0.0)))
    if c.nodes < 2:
        return rows
    return rows + [_diloco_row(m, t, c, h, outer, base) for h in sync_every]


def _diloco_row(m: Model, t: Training, c: Cluster, h: int, outer: str, base: float) -> LinkRow:
    """DiLoCo at H = ``h``, with the faster layout inside each node's group: DDP (every GPU
    all-reduces the whole pseudo-gradient with its peers in the other groups) or, on more than
    one GPU, ZeRO-3 (each GPU only its shard: 1/g of the bytes across the link, as INTELLECT-1's
    DiLoCo-FSDP2 hybrid)."""
    g = c.gpus_per_node
    share = dataclasses.replace(t, global_batch=t.global_batch // c.nodes)
    link = group_link(c, c.nodes, g)
    best: LinkRow | None = None
    inside = [("", Layout(dp_replicate=g), 1)]
    if g > 1:
        inside.append((" in ZeRO-3", Layout(dp_shard=g, zero=3), g))
    for label, lay, shards in inside:
        inner, inner_comm = _step(m, lay, share, _one_node(c))
        outer_s = outer_step_s(link, m.total_params() / shards, outer)
        step = diloco_step_s(inner, outer_s, h)
        row = LinkRow(
            f"DiLoCo H={h}{label}",
            step,
            inner_comm + outer_s / h,
            base / (c.nodes * step),
            h,
            m.total_params() / shards * OUTER_BYTES[outer] / h,
        )
        best = row if best is None or row.step_s < best.step_s else best
    assert best is not None
    return best


def _check(m: Model, t: Training, c: Cluster, sync_every: Sequence[int], outer: str) -> None:
    if not m.has_shape:
        raise PlanError("the slow-link rows need a model shape (--layers ... or --model)")
    if outer not in OUTER_BYTES:
        raise PlanError(f"outer precision {outer!r}: expected one of {', '.join(OUTER_BYTES)}")
    if not sync_every or min(sync_every) < 2:
        raise PlanError(
            f"--diloco {','.join(map(str, sync_every))}: every H (inner steps per outer "
            "step) must be >= 2; H = 1 is data parallel"
        )
    if t.global_batch % c.world:
        raise PlanError(
            f"--global-batch {t.global_batch} is not divisible by the {c.world} GPUs: the "
            "slow-link rows give every GPU the same share"
        )


def _one_node(c: Cluster) -> Cluster:
    return dataclasses.replace(c, nodes=1)


def _step(m: Model, lay: Layout, t: Training, c: Cluster) -> tuple[float, float]:
    """(step seconds, exposed communication seconds) of ``lay`` (micro-batch 1 unless it
    says otherwise)."""
    st = evaluate(m, lay, t, c).time
    if st is None:  # pragma: no cover - _check asked for a shape
        raise PlanError("the slow-link rows need a model shape")
    return st.total, st.exposed_comm + st.fsdp_overhead


# --- the recommendation --------------------------------------------------------------------

# What the papers state DiLoCo costs in convergence, each with its setup (docs/slow_links.md
# quotes them; nothing here is measured by meshrun except the last line's table).
CONVERGENCE = (
    "DiLoCo is not the same optimiser as data parallel: each group takes H steps alone and an "
    "outer Nesterov step applies the averaged change, so loss per token differs.",
    "Douillard et al. 2023 (DiLoCo, arXiv 2311.08105, abstract): on C4 with 8 workers, AdamW "
    "inner, Nesterov outer, many inner steps, 'performs as well as fully synchronous "
    "optimization while communicating 500 times less' (H = 500).",
    "Jaghouar et al. 2024 (INTELLECT-1, arXiv 2412.01152, abstract; H = 100 per its model "
    "card): a 10B model over 3 continents with an int8 outer all-reduce, '400x reduction in "
    "communication bandwidth' at 'comparable performance', 83-96% compute utilisation.",
    "Douillard et al. 2025 (Streaming DiLoCo, arXiv 2501.18512): fragments synchronised in "
    "turn, overlapped, 4-bit outer updates: 'similar' quality to data parallel with about two "
    "orders of magnitude less bandwidth (summary of the paper; its tables not verified here).",
    "Measured by meshrun on its demo (small, 2 hosts over 100 Mb/s): see docs/slow_links.md.",
)


@dataclass(frozen=True)
class Advice:
    choice: LinkRow
    lines: list[str]


def recommend(rows: Sequence[LinkRow], threshold: float = DEFAULT_THRESHOLD) -> Advice:
    """The synchronous layout with the best efficiency if it reaches ``threshold``; else the
    DiLoCo row with the smallest H that does (fewest local steps: closest to synchronous
    training), or the most efficient one; with the convergence caveat when DiLoCo is named."""
    if not 0 < threshold <= 1:
        raise PlanError(f"--efficiency-threshold {threshold!r}: must be in (0, 1]")
    sync = max((r for r in rows if not r.diloco), key=lambda r: r.efficiency)
    diloco = sorted((r for r in rows if r.diloco), key=lambda r: r.sync_every)
    if sync.efficiency >= threshold or not diloco:
        why = (
            f"keeps {sync.efficiency:.0%} scaling efficiency (threshold {threshold:.0%})"
            if sync.efficiency >= threshold
            else "(one node: no inter-node link to spare)"
        )
        return Advice(sync, [f"recommended: {sync.name}, {why}"])
    good = [r for r in diloco if r.efficiency >= threshold]
    pick = good[0] if good else max(diloco, key=lambda r: r.efficiency)
    lines = [
        f"recommended: {pick.name}: the best synchronous layout, {sync.name}, keeps only "
        f"{sync.efficiency:.0%} scaling efficiency (threshold {threshold:.0%}; "
        f"{sync.comm_share:.0%} of its step is communication); {pick.name} takes "
        f"{pick.step_s:.3g} s per step vs {sync.step_s:.3g} s ({sync.step_s / pick.step_s:.2f}x), "
        f"{pick.efficiency:.0%} efficiency",
        "config: [fault_tolerance] replica_groups = <nodes>, diloco_sync_every = "
        f"{pick.sync_every} (docs/slow_links.md)",
        "convergence cost:",
        *(f"  - {line}" for line in CONVERGENCE),
    ]
    return Advice(pick, lines)


def table_lines(rows: Sequence[LinkRow]) -> list[str]:
    """The rows as aligned text."""
    out = [
        f"{'layout':<34} {'step s':>10} {'comm s':>10} {'comm %':>7} {'efficiency':>10} "
        f"{'MB/GPU/step':>12}"
    ]
    for r in rows:
        out.append(
            f"{r.name:<34} {r.step_s:>10.4g} {r.comm_s:>10.4g} {r.comm_share:>7.0%} "
            f"{r.efficiency:>10.0%} {r.link_bytes / 1e6 if r.link_bytes else '-':>12.4}"
        )
    return out
