"""Context parallel in the cost model (pure): the sequence split over ``cp`` ranks, and what its
attention sends. docs/plan.md ("Context parallel") derives it.

- Activations: every rank keeps s/cp of each sequence's tokens (the K/V of the others only
  transiently), so activation memory is divided by cp (Megatron-Core's context parallelism;
  Liu et al. 2023, "Ring Attention with Blockwise Transformers", Sec. 3).
- Ring attention (torch's ``context_parallel``, Megatron's P2P ring): per attention layer
  each rank passes its K/V chunk around the ring, cp-1 times forward and twice that backward
  (K/V again and their gradients), overlapped with the chunk's attention math; what the math
  does not cover is exposed.
- Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses", Sec. 3): an all-to-all turns the
  sequence split into a head split before attention (q, k, v) and back after it (the output):
  4 all-to-alls forward and 4 backward per layer, each moving (cp-1)/cp of the rank's tensor;
  not hidden. It needs the heads divisible by tp x cp.
"""

from __future__ import annotations

import math

from meshrun.plan.inputs import Layout, Model, Training


def head_dim(m: Model) -> int:
    return m.head_dim or m.hidden // m.heads


def cp_problem(m: Model, lay: Layout, t: Training) -> str | None:
    """Why ``lay.cp`` cannot split this model's sequence, or None."""
    if lay.cp == 1:
        return None
    if not m.has_shape:
        return f"cp = {lay.cp} splits the sequence: give the model's shape, not --params"
    if m.seq % (2 * lay.cp):
        return (
            f"cp = {lay.cp} needs the sequence ({m.seq}) divisible by 2 x cp: each rank takes "
            "two chunks, one from each end, so that causal attention is balanced"
        )
    if t.cp_attention == "ulysses" and (m.heads % (lay.tp * lay.cp) or m.kv % lay.tp):
        return (
            f"Ulysses attention with cp = {lay.cp} x tp = {lay.tp} needs heads ({m.heads}) "
            "divisible by tp x cp; use ring attention (--cp-attention ring) or another cp"
        )
    return None


def ring_kv_bytes(m: Model, lay: Layout, elem_bytes: int) -> tuple[float, int]:
    """(bytes of one K/V chunk a rank sends, sends per layer and micro-batch) of ring
    attention: its tokens' keys and values (kv heads split over tp); cp-1 sends forward,
    2(cp-1) backward (K/V and dK/dV)."""
    if lay.cp == 1:
        return 0.0, 0
    tokens = lay.micro_batch * m.seq / lay.cp
    chunk = tokens * 2 * m.kv * head_dim(m) * elem_bytes / lay.tp
    return chunk, 3 * (lay.cp - 1)


def ulysses_bytes(m: Model, lay: Layout, elem_bytes: int) -> tuple[float, int]:
    """(bytes a rank sends per layer and micro-batch, all-to-alls per layer and micro-batch)
    of Ulysses attention: q, k, v before attention and its output after, forward and again
    backward, each (cp-1)/cp of the rank's tokens x their width (split over tp)."""
    if lay.cp == 1:
        return 0.0, 0
    tokens = lay.micro_batch * m.seq / lay.cp
    widths = (2 * m.heads + 2 * m.kv) * head_dim(m) / lay.tp  # q + out, k + v
    return 2.0 * tokens * widths * elem_bytes * (lay.cp - 1) / lay.cp, 8


def attention_flops_per_layer(m: Model, lay: Layout) -> float:
    """The attention scores' FLOPs (forward + backward) one rank does per layer and
    micro-batch: 12 x (s/cp) x s x heads x head_dim / tp, what ring attention's sends hide
    behind."""
    tokens = lay.micro_batch * m.seq / lay.cp
    return 12.0 * tokens * m.seq * m.heads * head_dim(m) / lay.tp


def stage_layers(m: Model, lay: Layout) -> int:
    return math.ceil(m.layers / lay.pp)


__all__ = [
    "attention_flops_per_layer",
    "cp_problem",
    "ring_kv_bytes",
    "stage_layers",
    "ulysses_bytes",
]
