"""The planner's pipeline bubble per schedule (plan/bubble.py) and the published figure it is
checked against: torchtitan's Llama 3.1 405B on 512 H100 (benchmarks/
llama3_h100_202412_torchtitan.md, Table 5: FSDP 8 x TP 8 x PP 8, local batch 32, seq 8192,
full AC, Float8 + compile + async TP): 1F1B 100 and interleaved 1F1B 128 tokens/s per GPU.
torchtitan at that run (commit 9dec370) splits each step into pp = 8 micro-batches when none
are set and places 2 stages per rank for looped schedules, so m = 8 (micro-batches of 4), v = 2.
"""

from __future__ import annotations

import pytest

from meshrun.plan.bubble import bubble_fraction
from meshrun.plan.cost import GB, Cluster, Layout, Model, Training, step_time
from meshrun.specs.gpus import get_gpu

PUBLISHED_RATIO = 128 / 100  # interleaved 1F1B / 1F1B, tokens/s per GPU


def test_bubble_per_schedule_at_equal_forward_backward_and_weight_times() -> None:
    p, m, v = 8, 8, 2
    got = {s: bubble_fraction(s, p, v, m) for s in ("1f1b", "gpipe", "interleaved", "zb1p")}
    assert got == pytest.approx(
        {"1f1b": 7 / 8, "gpipe": 7 / 8, "interleaved": 7 / 16, "zb1p": 7 / 48}
    )
    assert bubble_fraction("zbv", p, 2, m) == 0.0  # the Zero Bubble paper's ZB-V
    assert bubble_fraction("dualpipev", p, 2, m) == pytest.approx(7 / 24)
    assert bubble_fraction("1f1b", 1, 1, m) == 0.0
    # Weight gradients cheaper than the rest: ZB-V keeps a bubble, ZB1P a larger one.
    split = (0.4, 0.4, 0.2)
    assert bubble_fraction("zbv", p, 2, m, split) == pytest.approx(7 / 8 * 0.4 / 2)
    assert bubble_fraction("zb1p", p, 1, m, split) == pytest.approx(7 / 8 * 0.6)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb2p'"):
        bubble_fraction("zb2p", p, 1, m)


def llama_405b_step(schedule: str, vpp: int) -> float:
    """Seconds per step the planner predicts for the torchtitan row (uncalibrated)."""
    gpu = get_gpu("h100-sxm")
    c = Cluster(
        64,
        8,
        gpu.memory_gb * GB,
        gpu.peak_flops("bf16"),
        gpu.intra_bw,
        gpu.inter_bw,
        mem_bw=gpu.mem_bw,
        intra_latency=gpu.intra_latency,
        inter_latency=gpu.inter_latency,
    )
    m = Model(
        layers=126,
        hidden=16384,
        heads=128,
        vocab=128256,
        seq=8192,
        kv_heads=8,
        ffn=53248,
        gated_mlp=True,
    )
    lay = Layout(
        dp_shard=8,
        tp=8,
        pp=8,
        zero=3,
        micro_batch=4,
        activation_checkpointing="full",
        schedule=schedule,
        vpp=vpp,
    )
    return step_time(m, lay, Training(global_batch=256), c, microbatches=8).total


def test_the_405b_interleaved_speed_up_against_torchtitans_table_5() -> None:
    bubble_only = (1 + bubble_fraction("1f1b", 8, 1, 8)) / (
        1 + bubble_fraction("interleaved", 8, 2, 8)
    )
    whole = llama_405b_step("1f1b", 1) / llama_405b_step("interleaved", 2)
    print(
        f"405B interleaved / 1F1B: published {PUBLISHED_RATIO:.3f}, bubble term alone "
        f"{bubble_only:.3f}, whole step model {whole:.3f} ({100 * (whole / PUBLISHED_RATIO - 1):+.1f} %)"
    )
    assert bubble_only == pytest.approx(1.875 / 1.4375)
    assert whole == pytest.approx(PUBLISHED_RATIO, rel=0.10)
