"""The pipeline bubble per schedule: the idle fraction of a step's compute on each rank.

With p pipeline ranks, m micro-batches per step, v stages per rank and each micro-batch's
compute on a rank split into forward F, input-gradient backward B and weight-gradient
backward W (F + B + W = 1), the idle time per step as a fraction of the step's compute:

| schedule | bubble / compute | source |
|---|---|---|
| gpipe, 1f1b | (p-1) / m | Narayanan et al. 2021 (Megatron-LM), Sec. 2.2.1 |
| interleaved | (p-1) / (v m) | ibid., Sec. 2.2.2 |
| zb1p | (p-1) (F + B - W) / (v m) | Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 2.1 (ZB-H1: (p-1)(T_F + T_B - T_W)); v chunks per rank shorten it v times as interleaving does |
| zbv | (p-1) max(0, F + B - 2W) / (2 m) | ibid., Sec. 6 (ZB-V: zero at T_F = T_B = T_W); the ZB-H2 residue (p-1)(T_F + T_B - 2 T_W) in chunks of half a rank's layers |
| dualpipev | (p-1) (F + 2B - W) / (2 m) | DeepSeek-V3 report (arXiv 2412.19437), Table 2: (PP/2 - 1)(F&B + B - 3W) per chunk with PP = 2p chunk stages; torch runs an overlapped F&B pair one after the other, so F&B = F + B + W here |

At the split the papers assume, F = B = W = 1/3 (a matmul's backward is two matmuls of its
forward's size, one for the input's gradient and one for the weight's), the rows give
(p-1)/m, (p-1)/(vm), (p-1)/(3vm), 0 and (p-1)/(3m): the sail-sg comparison table of the Zero
Bubble paper's repository (1F1B (p-1)/m, ZB1P (p-1)/(3m), ZBV 0). Full activation
recomputation re-runs each block's forward before its input gradient, so B grows by one F:
F = W = 1/4, B = 1/2 (selective recomputation re-runs attention's cheap part: kept 1/3 each).
The one-stage and interleaved rows do not depend on the split.
"""

from __future__ import annotations

__all__ = ["SPLIT", "bubble_fraction", "split_for"]

SPLIT = (1 / 3, 1 / 3, 1 / 3)  # (F, B, W): forward, input gradient, weight gradient
SPLIT_FULL_AC = (1 / 4, 1 / 2, 1 / 4)  # the recomputed forward runs inside B


def split_for(activation_checkpointing: str) -> tuple[float, float, float]:
    """(F, B, W) of a micro-batch's compute under the layout's recomputation."""
    return SPLIT_FULL_AC if activation_checkpointing == "full" else SPLIT


def bubble_fraction(
    schedule: str, pp: int, vpp: int, microbatches: int, split: tuple[float, float, float] = SPLIT
) -> float:
    """Idle time per step / compute per step of one rank (the table above)."""
    if pp <= 1:
        return 0.0
    f, b, w = split
    per = (pp - 1) / microbatches
    if schedule in ("gpipe", "1f1b"):
        return per
    if schedule == "interleaved":
        return per / vpp
    if schedule == "zb1p":
        return per * (f + b - w) / vpp
    if schedule == "zbv":
        return per * max(0.0, f + b - 2 * w) / 2
    if schedule == "dualpipev":
        return per * (f + 2 * b - w) / 2
    raise ValueError(f"bubble_fraction: unknown pipeline schedule {schedule!r}")
