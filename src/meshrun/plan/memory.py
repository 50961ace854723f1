"""The memory side of the cost model (pure): model states by the ZeRO paper's accounting
(Rajbhandari et al. 2020, Sec. 3.1 and 5: 2 + 2 + K bytes per parameter, sharded from stage
1, 2 and 3) and activations by Korthikanti et al. 2022 (Sec. 4 and Table 2), per rank of one
layout. docs/plan.md derives the formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshrun.plan.inputs import GB, Cluster, Layout, Model, Recompute, Training
from meshrun.plan.moe import (
    expert_params,
    expert_shard,
    expert_stage_params,
    moe_activation_per_token,
    rank_load,
)

# --- memory (ZeRO paper accounting, Korthikanti activations) -------------------------------


def state_bytes_per_param(t: Training) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter: 2 + 2 + K in mixed precision.

    K = 12 for Adam (fp32 master weights, momentum, variance), 8 for SGD with momentum (master
    weights, momentum); in fp32, 4 + 4 + 8 (Adam) or 4 + 4 + 4 (SGD).
    """
    adam = t.optimizer in ("adam", "adamw")
    if t.precision == "fp32":
        return 4, 4, 8 if adam else 4
    return 2, 2, 12 if adam else 8


def model_state_bytes(params: float, t: Training, zero: int, shard: int) -> tuple[float, ...]:
    """(params, grads, optimizer) bytes on one GPU for ``params`` parameters, ZeRO stage
    ``zero`` sharded over ``shard`` ranks (Rajbhandari et al. 2020, Sec. 5.1, Fig. 1)."""
    p, g, k = state_bytes_per_param(t)
    return (
        p * params / (shard if zero >= 3 else 1),
        g * params / (shard if zero >= 2 else 1),
        k * params / (shard if zero >= 1 else 1),
    )


def activation_bytes_per_layer(
    m: Model,
    micro_batch: int,
    tp: int,
    recompute: Recompute,
    fused: bool = False,
    load: float = 1.0,
) -> float:
    """Korthikanti et al. 2022, Table 2, with tensor and sequence parallelism over ``tp``:
    s*b*h*(34 + 5*a*s/h)/t, selective recomputation s*b*h*34/t, full recomputation 2*s*b*h/t.

    The 34 is 18 + 4*ffn/h (attention 11, LayerNorms 4, MLP 3 + 4*ffn/h), so a different MLP
    width changes it (a gated MLP keeps three ffn-wide tensors: 6*ffn/h); GQA's smaller K/V are not credited (an overestimate). ``fused``
    attention stores no scores, like selective recomputation (which it effectively is)."""
    s, b, h = m.seq, micro_batch, m.hidden
    if recompute == "full":
        return 2.0 * s * b * h / tp
    if m.moe is not None:  # routed slots and shared experts instead of one MLP (plan/moe.py)
        per_token = moe_activation_per_token(m, load)  # the busiest rank's routed tokens
    else:
        per_token = 18.0 + (6.0 if m.gated_mlp else 4.0) * m.ffn_size / h
    if recompute == "none" and not fused:
        per_token += 5.0 * m.heads * s / h
    return s * b * h * per_token / tp


def inflight_layers(m: Model, lay: Layout, microbatches: int) -> float:
    """Layer-activations the first pipeline stage holds at its peak.

    1F1B keeps min(p, m) microbatches of l/p layers (= l when m >= p), times
    1 + (p-1)/(p*v) for the interleaved schedule (Korthikanti et al. 2022, Sec. 4.2.3);
    GPipe keeps all m microbatches."""
    per_stage = m.layers / lay.pp
    if lay.pp == 1:
        return float(m.layers)
    if lay.schedule == "gpipe":
        return per_stage * microbatches
    held = per_stage * min(lay.pp, microbatches)
    if lay.schedule == "interleaved":
        held *= 1.0 + (lay.pp - 1) / (lay.pp * lay.vpp)
    return held


def activation_bytes(m: Model, lay: Layout, t: Training, microbatches: int) -> float:
    """Activations on one GPU: stored layers, plus one layer's full working set while it is
    recomputed (full recomputation), plus the fp32 logits of the loss, 4*s*b*V/t. Context
    parallel keeps s/cp of every sequence: all of it divided by cp."""
    if not m.has_shape:
        return 0.0
    b, ac, fused = lay.micro_batch, lay.activation_checkpointing, t.fused_attention
    tp = lay.tp * lay.cp  # both split the tokens' activations (tp by sequence parallelism)
    load = rank_load(m, lay)
    per_layer = activation_bytes_per_layer(m, b, tp, ac, fused, load)
    stored = inflight_layers(m, lay, microbatches) * per_layer
    if ac == "full":
        stored += activation_bytes_per_layer(m, b, tp, "none", fused, load)
    stored += 4.0 * m.seq * b * m.vocab / (tp if t.tp_embeddings else lay.cp)
    # The published constants count 16-bit tensors; fp32 training doubles them.
    return stored * (2.0 if t.precision == "fp32" else 1.0)


@dataclass
class Memory:
    """Bytes per GPU (the most loaded one: the first pipeline stage)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def as_gb(self) -> dict[str, float]:
        fields = ("params", "grads", "optimizer", "activations", "buffers")
        out = {k: round(getattr(self, k) / GB, 3) for k in fields}
        out["total"] = round(self.total / GB, 3)
        return out


def stage_params(m: Model, lay: Layout, t: Training | None = None) -> float:
    """Parameters on one GPU before data-parallel sharding: a pipeline stage's blocks divided by
    tensor parallelism, plus the embeddings and output layer (counted on the first stage, the
    most loaded), divided by it only when the TP plan splits them (``tp_embeddings``)."""
    if not m.has_shape:
        return m.total_params() / (lay.tp * lay.pp)
    blocks = math.ceil(m.layers / lay.pp) * m.params_per_layer()
    embeddings = m.total_params() - m.layers * m.params_per_layer()
    split = lay.tp if t is not None and t.tp_embeddings else 1
    return blocks / lay.tp + embeddings / split


def rank_params(m: Model, lay: Layout, t: Training | None = None) -> tuple[float, float]:
    """(non-expert, routed-expert) parameters on one GPU before ZeRO sharding: the routed
    experts are split over ep (not over tp: one expert's matmuls stay whole), the rest as
    :func:`stage_params` says."""
    experts = expert_stage_params(m, lay)
    return stage_params(m, lay, t) - experts / lay.tp, experts / lay.ep


def memory(m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int) -> Memory:
    """The per-GPU memory breakdown of a layout (see docs/plan.md). The non-expert states are
    sharded over dp_shard x cp, the experts' over the ranks that hold the same experts
    (dp_shard x cp x tp / ep)."""
    dense, experts = rank_params(m, lay, t)
    states = model_state_bytes(dense, t, lay.zero, lay.shard)
    expert_states = model_state_bytes(experts, t, lay.zero, expert_shard(lay))
    p, g, o = (a + b for a, b in zip(states, expert_states, strict=True))
    act = activation_bytes(m, lay, t, microbatches)
    gather = _gather_buffer(m, lay, t)
    buffers = c.allowance_bytes + gather + c.fragmentation * (p + g + o + act + gather)
    return Memory(p, g, o, act, buffers)


def _gather_buffer(m: Model, lay: Layout, t: Training) -> float:
    # ZeRO-3/FSDP gathers one block's full parameters and prefetches the next: two blocks.
    if lay.zero < 3 or not m.has_shape:
        return 0.0
    routed = expert_params(m) / m.layers
    per_layer = (m.params_per_layer() - routed) / lay.tp + routed / lay.ep
    return 2.0 * per_layer * state_bytes_per_param(t)[0]
