"""Layout search: enumerate, check, evaluate, rank; and what would fit when nothing does.

Pure: no torch, no process group. Every rejected input raises :class:`PlanError` naming the
flag or key, the value, what is allowed and how to fix it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from meshrun.plan.cost import GB, Cluster, Estimate, Layout, Model, Recompute, Training, evaluate
from meshrun.plan.errors import PlanError
from meshrun.plan.long_seq import cp_problem
from meshrun.plan.moe import ep_stride, moe_problem
from meshrun.specs.gpus import GPUS

__all__ = ["Plan", "PlanError", "evaluate_one", "search", "what_would_fit"]


DEFAULT_MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
DEFAULT_RECOMPUTE: tuple[Recompute, ...] = ("none", "selective", "full")
MAX_EP = 64  # expert-parallel degrees searched by default: the divisors up to this


# --- checks --------------------------------------------------------------------------------


def check_model(m: Model) -> None:
    """Reject shapes no transformer has (before any search)."""
    if not m.has_shape:
        if m.params <= 0:
            raise PlanError(
                "give a model: --layers/--hidden/--heads/--vocab/--seq, --params N "
                "or --model pkg.module:factory"
            )
        return
    for name in ("layers", "hidden", "heads", "vocab", "seq"):
        if getattr(m, name) <= 0:
            raise PlanError(f"--{name} = {getattr(m, name)} is not allowed: must be >= 1")
    if m.hidden % m.heads:
        raise PlanError(
            f"--hidden {m.hidden} is not divisible by --heads {m.heads}; "
            "choose a hidden size that is a multiple of the head count"
        )
    if m.heads % m.kv:
        raise PlanError(
            f"--kv-heads {m.kv} does not divide --heads {m.heads}; grouped-query "
            "attention needs heads = kv_heads x group size"
        )


def layout_problem(m: Model, lay: Layout, t: Training, c: Cluster) -> str | None:
    """Why ``lay`` cannot run this model on this cluster, or None."""
    if lay.size != c.world:
        return (
            f"dp_replicate x dp_shard x cp x tp x pp = {lay.dp_replicate} x {lay.dp_shard} x "
            f"{lay.cp} x {lay.tp} x {lay.pp} = {lay.size}, but the cluster has {c.world} GPUs"
        )
    problem = moe_problem(m, lay) or cp_problem(m, lay, t)
    if problem:
        return problem
    if lay.zero >= 1 and lay.shard == 1:
        return f"zero = {lay.zero} with dp_shard = 1 shards nothing; use zero = 0 or dp_shard > 1"
    if t.global_batch % (lay.micro_batch * lay.dp):
        return (
            f"global batch {t.global_batch} is not divisible by micro_batch x data-parallel "
            f"size = {lay.micro_batch} x {lay.dp}"
        )
    return _shape_problem(m, lay, t.global_batch // (lay.micro_batch * lay.dp))


def _shape_problem(m: Model, lay: Layout, microbatches: int) -> str | None:
    if m.has_shape:
        for name, value in (
            ("heads", m.heads),
            ("kv_heads", m.kv),
            ("hidden", m.hidden),
            ("ffn", m.ffn_size),
        ):
            if value % lay.tp:
                return f"tp = {lay.tp} does not divide {name} = {value}; use a divisor of it"
        if m.layers % (lay.pp * lay.vpp):
            return (
                f"pp x vpp = {lay.pp} x {lay.vpp} does not divide layers = {m.layers}; "
                "use a divisor so that every stage holds the same number of blocks"
            )
    if lay.pp > 1 and microbatches < lay.pp:
        return (
            f"pp = {lay.pp} needs at least {lay.pp} micro-batches per step, this layout has "
            f"{microbatches}; lower micro_batch or raise the global batch"
        )
    if lay.schedule in ("zbv", "dualpipev") and lay.vpp != 2:
        return f"schedule = {lay.schedule} holds 2 stages per rank in a V: set vpp = 2"
    if lay.vpp > 1 and lay.schedule not in ("interleaved", "zb1p", "zbv", "dualpipev"):
        return f"vpp = {lay.vpp} needs schedule = interleaved or zb1p (or zbv, dualpipev: 2)"
    return _schedule_problem(lay, microbatches) if lay.pp > 1 else None


def _schedule_problem(lay: Layout, microbatches: int) -> str | None:
    """What the run refuses of a multi-stage schedule's micro-batches (config/world.py: what
    torch's schedule classes refuse), so that no such layout is proposed or traced."""
    from meshrun.config import ConfigError, ParallelConfig
    from meshrun.config.world import PP_LOOPED, PP_V_SHAPED, check_pipeline_schedule

    if lay.schedule not in PP_LOOPED + PP_V_SHAPED:
        return None
    cfg = ParallelConfig(
        pp=lay.pp,
        pp_schedule=lay.schedule,
        pp_virtual_stages=lay.vpp,
        pp_microbatches=microbatches,
    )
    try:
        check_pipeline_schedule(cfg, f"pp={lay.pp}")
    except ConfigError as err:
        return str(err)
    return None


def check_layout(m: Model, lay: Layout, t: Training, c: Cluster) -> None:
    problem = layout_problem(m, lay, t, c)
    if problem:
        raise PlanError(f"--layout: {problem}")


# --- search --------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    m: Model,
    t: Training,
    c: Cluster,
    micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES,
    recompute: Sequence[Recompute] = DEFAULT_RECOMPUTE,
    eps: Sequence[int] | None = None,
    cps: Sequence[int] = (1,),
) -> Iterator[Layout]:
    """Every valid layout: tp inside a node, pp over whole blocks, dp split into replicate x
    shard (hybrid only with ZeRO), ZeRO 0-3, the micro-batches and recomputation modes given;
    the context-parallel sizes ``cps`` and the expert-parallel sizes ``eps`` (None: for an MoE
    model every divisor of its experts up to MAX_EP that divides dp_shard x cp x tp)."""
    tps = [d for d in _divisors(c.gpus_per_node) if d <= c.world]
    acs: Sequence[Recompute] = recompute if m.has_shape else ("none",)
    for cp in cps:
        for tp in (d for d in tps if c.world % (d * cp) == 0):
            for pp in _divisors(c.world // (tp * cp)):
                dp = c.world // (tp * pp * cp)
                for zero, dp_rep in _dp_splits(dp):
                    for ep in _ep_sizes(m, eps, dp // dp_rep * cp * tp):
                        for mb in micro_batches:
                            for ac in acs:
                                lay = Layout(
                                    dp_rep, dp // dp_rep, tp, pp, zero, mb, ac, ep=ep, cp=cp
                                )
                                if layout_problem(m, lay, t, c) is None:
                                    yield lay


def _ep_sizes(m: Model, eps: Sequence[int] | None, shard: int) -> list[int]:
    if eps is not None:
        return [e for e in eps if shard % e == 0]
    if m.moe is None:
        return [1]
    return [e for e in _divisors(min(shard, MAX_EP)) if shard % e == 0 and m.moe.experts % e == 0]


def _dp_splits(dp: int) -> Iterator[tuple[int, int]]:
    yield 0, 1  # DDP over the whole data-parallel group
    for zero in (1, 2, 3):
        for rep in _divisors(dp):
            if dp // rep > 1:
                yield zero, rep


@dataclass
class Plan:
    """The ranked result of a search."""

    params: int
    estimates: list[Estimate]  # fitting layouts first, best first
    evaluated: int

    @property
    def fitting(self) -> list[Estimate]:
        return [e for e in self.estimates if e.fits]


def _rank_key(e: Estimate) -> tuple[float, ...]:
    # Fitting layouts fastest first; a bare parameter count has no time, and a layout that
    # does not fit is only a hint, so those go smallest memory first. Ties go to the simpler
    # layout (fewer dimensions in use).
    speed = -e.tokens_per_s if e.time is not None and e.fits else e.memory.total
    lay = e.layout
    return (not e.fits, speed, e.memory.total, lay.tp * lay.pp, lay.zero)


def search(
    m: Model,
    t: Training,
    c: Cluster,
    micro_batches: Sequence[int] = DEFAULT_MICRO_BATCHES,
    recompute: Sequence[Recompute] = DEFAULT_RECOMPUTE,
    eps: Sequence[int] | None = None,
    cps: Sequence[int] = (1,),
) -> Plan:
    """Evaluate every candidate layout and rank them: those that fit, fastest first."""
    check_model(m)
    found = candidates(m, t, c, micro_batches, recompute, eps, cps)
    estimates = [evaluate(m, lay, t, c) for lay in found]
    if not estimates:
        raise PlanError(
            f"no layout divides the work: global batch {t.global_batch} over {c.world} GPUs "
            f"with micro-batches {list(micro_batches)}; use a global batch that is a multiple "
            f"of {c.world} (or of the data-parallel size you want)"
        )
    estimates.sort(key=_rank_key)
    return Plan(m.total_params(), estimates, len(estimates))


def evaluate_one(m: Model, lay: Layout, t: Training, c: Cluster) -> Plan:
    """The ``--layout`` mode: check and evaluate one given layout."""
    check_model(m)
    check_layout(m, lay, t, c)
    e = evaluate(m, lay, t, c)
    if lay.tp > c.gpus_per_node:
        e.notes.append(f"tp = {lay.tp} spans nodes: its all-reduces cross the network")
    if lay.ep * ep_stride(lay) > c.gpus_per_node:
        e.notes.append(f"ep = {lay.ep} spans nodes: its all-to-alls cross the network")
    return Plan(m.total_params(), [e], 1)


# --- parsing a --layout ----------------------------------------------------------------------

_LAYOUT_KEYS = {f.name: f.type for f in dataclasses.fields(Layout)}


def parse_layout(text: str, c: Cluster) -> Layout:
    """``dp_shard=64,zero=1,tp=8,micro_batch=2,activation_checkpointing=full``; ``dp_shard``
    left out (or -1) = what is left of the cluster."""
    values: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key = {"ac": "activation_checkpointing"}.get(key.strip(), key.strip())
        if not sep or key not in _LAYOUT_KEYS:
            raise PlanError(
                f"--layout item {item!r}: expected KEY=VALUE with KEY one of "
                f"{', '.join(_LAYOUT_KEYS)}"
            )
        values[key] = _layout_value(key, value.strip())
    lay = replace(Layout(dp_shard=-1), **values)  # type: ignore[arg-type]
    if lay.dp_shard == -1:
        rest = lay.dp_replicate * lay.cp * lay.tp * lay.pp
        if c.world % rest:
            raise PlanError(
                f"--layout: dp_replicate x cp x tp x pp = {rest} does not divide the "
                f"cluster's {c.world} GPUs"
            )
        lay = replace(lay, dp_shard=c.world // rest)
    return lay


def _layout_value(key: str, value: str) -> object:
    allowed: tuple[str, ...]
    if key == "activation_checkpointing":
        allowed = ("none", "selective", "full")
    elif key == "schedule":
        allowed = ("1f1b", "gpipe", "interleaved", "zb1p", "zbv", "dualpipev")
    else:
        try:
            number = int(value)
        except ValueError:
            raise PlanError(f"--layout {key}={value!r}: expected an integer") from None
        low = -1 if key == "dp_shard" else 0 if key == "zero" else 1
        if number < low or (key == "zero" and number > 3):
            raise PlanError(
                f"--layout {key}={number}: must be "
                + ("0, 1, 2 or 3" if key == "zero" else f">= {low}")
            )
        return number
    if value not in allowed:
        raise PlanError(f"--layout {key}={value!r}: expected one of {', '.join(allowed)}")
    return value


# --- when nothing fits -----------------------------------------------------------------------


def what_would_fit(m: Model, t: Training, c: Cluster, plan: Plan) -> list[str]:
    """Concrete alternatives when no layout fits: offload, more GPUs, a bigger GPU, a smaller
    micro-batch."""
    best = min(plan.estimates, key=lambda e: e.memory.total)
    mem, cap = best.memory, c.memory_bytes
    out = [
        f"the smallest footprint found is {mem.total / GB:.1f} GB per GPU "
        f"({_describe(best)}); the GPU has {cap / GB:.1f} GB"
    ]
    if mem.total - mem.optimizer <= cap:
        out.append(
            f"offload the optimizer states to CPU ({mem.optimizer / GB:.1f} GB per GPU), "
            "e.g. FSDP2 CPUOffloadPolicy: then it fits"
        )
    if best.layout.micro_batch > 1:
        out.append("allow micro-batch 1 (--micro-batch 1)")
    nodes = _nodes_that_fit(m, t, c)
    if nodes:
        out.append(f"use {nodes} nodes ({nodes * c.gpus_per_node} GPUs) instead of {c.nodes}")
    bigger = [g.name for g in GPUS.values() if g.memory_gb * GB >= mem.total]
    if bigger:
        out.append(f"use GPUs with more memory: {', '.join(bigger)}")
    return out


def _describe(e: Estimate) -> str:
    lay = e.layout
    return (
        f"dp_replicate={lay.dp_replicate}, dp_shard={lay.dp_shard}, tp={lay.tp}, "
        f"pp={lay.pp}, ep={lay.ep}, cp={lay.cp}, zero={lay.zero}, micro_batch={lay.micro_batch}, "
        f"activation_checkpointing={lay.activation_checkpointing}"
    )


def _nodes_that_fit(m: Model, t: Training, c: Cluster) -> int | None:
    # Only the memory-lean corner (ZeRO-3, micro-batch 1, full recomputation) is tried, at
    # 2x, 4x, ... the nodes, with the global batch kept.
    nodes = c.nodes
    while nodes * c.gpus_per_node < 65536:
        nodes *= 2
        bigger = replace(c, nodes=nodes)
        lean = candidates(m, t, bigger, (1,), ("full",))
        if any(evaluate(m, lay, t, bigger).fits for lay in lean if lay.zero == 3):
            return nodes
    return None
