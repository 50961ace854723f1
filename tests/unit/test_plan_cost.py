"""The cost model reproduces published figures to the precision they were printed with.

Sources (docs/plan.md lists them with the tables used):
- ZeRO: Rajbhandari et al. 2020, arXiv:1910.02054, Table 1 and Figure 1.
- Megatron-LM: Narayanan et al. 2021, arXiv:2104.04473, Table 1 and Sec. 5.1.
- Korthikanti et al. 2022, arXiv:2205.05198, Table 2 and Sec. 5.
"""

from __future__ import annotations

from dataclasses import replace
from decimal import ROUND_HALF_UP, Decimal

import pytest

from meshrun.plan.cost import (
    GB,
    Cluster,
    Layout,
    Model,
    Training,
    all_reduce_time,
    ddp_buckets,
    flops_per_iteration,
    fsdp_collectives,
    fsdp_units,
    gather_time,
    gpt_params,
    group_link,
    logits_flops,
    stage_params,
    step_time,
    training_days,
)
from meshrun.plan.memory import activation_bytes_per_layer, inflight_layers, model_state_bytes


def printed(value: float, like: str) -> str:
    """``value`` rounded half-up to as many decimals as the published figure ``like`` shows."""
    decimals = len(like.split(".")[1]) if "." in like else 0
    quantum = Decimal(1).scaleb(-decimals)
    return str(Decimal(repr(value)).quantize(quantum, rounding=ROUND_HALF_UP))


# ZeRO Table 1, 7.5B model: per-device model-state memory (GB) for P_os, P_os+g, P_os+g+p.
ZERO_TABLE_1_7B5 = {
    1: ("120", "120", "120"),
    4: ("52.5", "41.3", "30"),
    16: ("35.6", "21.6", "7.5"),
    64: ("31.4", "16.6", "1.88"),
    256: ("30.4", "15.4", "0.47"),
    1024: ("30.1", "15.1", "0.12"),
}
MIXED_ADAM = Training(precision="bf16", optimizer="adam")


def zero_gb(params: float, stage: int, dp: int) -> float:
    return sum(model_state_bytes(params, MIXED_ADAM, stage, dp)) / GB


@pytest.mark.parametrize("dp", sorted(ZERO_TABLE_1_7B5))
def test_zero_table_1_model_states_of_the_7_5b_model(dp: int) -> None:
    for stage, figure in zip((1, 2, 3), ZERO_TABLE_1_7B5[dp], strict=True):
        assert printed(zero_gb(7.5e9, stage, dp), figure) == figure, (dp, stage)


def test_zero_figure_1_and_the_text() -> None:
    # Figure 1: 7.5B parameters, K = 12, N_d = 64 -> 120 / 31.4 / 16.6 / 1.9 GB.
    figures = [(0, "120"), (1, "31.4"), (2, "16.6"), (3, "1.9")]
    assert [printed(zero_gb(7.5e9, s, 64), f) for s, f in figures] == [f for _, f in figures]
    # Sec. 3.1: a 1.5B GPT-2 needs at least 24 GB of model states (16 bytes per parameter).
    assert zero_gb(1.5e9, 0, 1) == pytest.approx(24.0)
    # Sec. 1: a trillion parameters need 16 TB of model states without ZeRO.
    assert zero_gb(1e12, 0, 1) == pytest.approx(16_000.0)


# Megatron-LM Table 1: (billions printed, heads, hidden, layers); V = 51,200, s = 2048.
MEGATRON_TABLE_1 = [
    ("1.7", 24, 2304, 24),
    ("3.6", 32, 3072, 30),
    ("7.5", 32, 4096, 36),
    ("18.4", 48, 6144, 40),
    ("39.1", 64, 8192, 48),
    ("76.1", 80, 10240, 60),
    ("145.6", 96, 12288, 80),
    ("310.1", 128, 16384, 96),
    ("529.6", 128, 20480, 105),
    ("1008.0", 160, 25600, 128),
]


def megatron_model(heads: int, hidden: int, layers: int) -> Model:
    return Model(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048)


@pytest.mark.parametrize(("billions", "heads", "hidden", "layers"), MEGATRON_TABLE_1)
def test_megatron_table_1_parameter_counts(
    billions: str, heads: int, hidden: int, layers: int
) -> None:
    m = megatron_model(heads, hidden, layers)
    h, l_, v, s = hidden, layers, 51200, 2048
    formula = 12 * l_ * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * l_ * h))
    assert gpt_params(m) == pytest.approx(formula, rel=1e-12)
    assert printed(gpt_params(m) / 1e9, billions) == billions


def test_megatron_flops_formula_with_and_without_recomputation() -> None:
    b, s, h, l_, v = 1536, 2048, 12288, 96, 51200  # GPT-3 shaped
    m = Model(layers=l_, hidden=h, heads=96, vocab=v, seq=s)
    core = b * s * l_ * h**2 * (1 + s / (6 * h) + v / (16 * l_ * h))
    assert flops_per_iteration(m, b, "none") == pytest.approx(72 * core, rel=1e-9)
    assert flops_per_iteration(m, b, "full") == pytest.approx(96 * core, rel=1e-9)
    selective = 72 * b * s * l_ * h**2 * (1 + s / (3 * h) + v / (16 * l_ * h))
    assert flops_per_iteration(m, b, "selective") == pytest.approx(selective, rel=1e-9)


def test_megatron_training_time_estimates() -> None:
    # Sec. 5.1: GPT-3 (175B) on 300B tokens, 1024 A100s at 140 TFLOP/s: "34 days"; the 1T model
    # (1008.0B, Table 1) on 450B tokens, 3072 A100s at 163 TFLOP/s: "84 days".
    assert round(training_days(300e9, 175e9, 1024, 140e12)) == 34
    assert round(training_days(450e9, 1008.0e9, 3072, 163e12)) == 84


def test_korthikanti_activation_memory_and_selective_savings() -> None:
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3
    m = Model(layers=96, hidden=h, heads=a, vocab=51200, seq=s)
    assert activation_bytes_per_layer(m, b, 1, "none") == s * b * h * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(m, b, 8, "none") == s * b * h * (34 + 5 * a * s / h) / 8
    assert activation_bytes_per_layer(m, b, 8, "selective") == s * b * h * 34 / 8
    assert activation_bytes_per_layer(m, b, 8, "full") == 2 * s * b * h / 8
    # Sec. 5: selective recomputation saves 70% (GPT-3) and 65% (MT-NLG 530B) of activations.
    saved = 1 - activation_bytes_per_layer(m, b, 8, "selective") / activation_bytes_per_layer(
        m, b, 8, "none"
    )
    assert round(saved * 100) == 70
    mt = Model(layers=105, hidden=20480, heads=128, vocab=51200, seq=2048)
    saved_mt = 1 - activation_bytes_per_layer(mt, b, 8, "selective") / activation_bytes_per_layer(
        mt, b, 8, "none"
    )
    assert round(saved_mt * 100) == 65


def test_pipeline_in_flight_microbatches() -> None:
    m = Model(layers=32, hidden=1024, heads=16, vocab=1000, seq=512)
    # 1F1B: the first stage holds p micro-batches of l/p layers = l layers' worth.
    assert inflight_layers(m, Layout(pp=4), microbatches=16) == 32
    assert inflight_layers(m, Layout(pp=4), microbatches=2) == 16  # only 2 ever in flight
    assert inflight_layers(m, Layout(pp=4, schedule="gpipe"), microbatches=16) == 8 * 16
    inter = Layout(pp=4, schedule="interleaved", vpp=2)
    assert inflight_layers(m, inter, microbatches=16) == pytest.approx(32 * (1 + 3 / 8))


def test_collectives_follow_the_nccl_tests_conventions() -> None:
    assert all_reduce_time(8, 1e9, 1e9) == pytest.approx(2 * 7 / 8)
    assert gather_time(8, 1e9, 1e9) == pytest.approx(7 / 8)
    assert all_reduce_time(1, 1e9, 1e9) == 0.0
    c = Cluster(2, 8, 80 * GB, 1e15, intra_bw=400e9, inter_bw=50e9, comm_efficiency=1.0)
    assert group_link(c, 8, 1).bw == 400e9  # tp=8 inside a node
    assert group_link(c, 2, 8).bw == 50e9  # 2 replicas 8 GPUs apart: across nodes
    assert group_link(c, 16, 1).bw == 50e9


def test_alpha_beta_adds_the_ring_steps_latency() -> None:
    # Thakur et al. 2005: ring all-reduce 2(n-1) steps, reduce-scatter / all-gather n-1.
    assert all_reduce_time(8, 1e9, 1e9, latency=1e-5) == pytest.approx(2 * 7 / 8 + 14e-5)
    assert gather_time(8, 1e9, 1e9, latency=1e-5) == pytest.approx(7 / 8 + 7e-5)
    c = Cluster(
        2,
        8,
        80 * GB,
        1e15,
        400e9,
        50e9,
        comm_efficiency=1.0,
        intra_latency=2e-6,
        inter_latency=9e-6,
        all_gather_ratio=0.5,
        reduce_scatter_ratio=0.25,
    )
    inside, across = group_link(c, 8, 1), group_link(c, 2, 8)
    assert (inside.latency, across.latency) == (2e-6, 9e-6)
    assert (inside.ag_bw, inside.rs_bw) == (200e9, 100e9)
    # 10 calls of 1/10 of the bytes: the same bandwidth term, 10x the latency.
    one, ten = inside.all_gather(8e9), inside.all_gather(8e9, calls=10)
    assert ten - one == pytest.approx(9 * 7 * 2e-6)


def test_collective_counts_of_ddp_and_fsdp2() -> None:
    # DDP: a 1 MiB first bucket, then 25 MiB buckets (torch's defaults).
    assert ddp_buckets(2**20) == 1 and ddp_buckets(2**20 + 1) == 2
    assert ddp_buckets(51 * 2**20) == 3
    m = Model(layers=8, hidden=512, heads=8, vocab=1000, seq=256)
    assert fsdp_units(m, Layout(pp=2)) == 5  # 4 blocks on the stage + the root
    lat = Cluster(1, 2, 80 * GB, 1e12, 1e9, 1e9, comm_efficiency=1.0, intra_latency=1e-3)
    t = Training(global_batch=8, precision="fp32")

    def dp(zero: int, c: Cluster) -> float:
        return step_time(m, Layout(dp_shard=2, zero=zero, micro_batch=2), t, c, 2).dp_comm

    # Latency alone (bandwidth term the same): DDP 2 steps per bucket; ZeRO-2 all-gathers
    # 9 units per micro-batch (2) + 9 reduce-scatters; ZeRO-3 also 8 blocks per backward.
    no_lat = replace(lat, intra_latency=0.0)
    buckets = ddp_buckets(stage_params(m, Layout()) * 4)
    assert buckets == 5  # 25.9M fp32 parameters: 1 MiB + 4 x 25 MiB
    assert dp(0, lat) - dp(0, no_lat) == pytest.approx(buckets * 2e-3)
    assert dp(2, lat) - dp(2, no_lat) == pytest.approx((2 * 9 + 9) * 1e-3)
    assert dp(3, lat) - dp(3, no_lat) == pytest.approx((2 * (9 + 8) + 9) * 1e-3)


def test_tp_ranks_each_compute_the_whole_output_layer() -> None:
    m = Model(layers=4, hidden=256, heads=4, vocab=50000, seq=128)
    c = Cluster(1, 2, 80 * GB, 1e12, 1e9, 1e9)
    t = Training(global_batch=8)
    dp2 = step_time(m, Layout(dp_shard=2, micro_batch=4), t, c, 1)
    tp2 = step_time(m, Layout(tp=2, micro_batch=8), t, c, 1)
    extra = logits_flops(m, 8) / (2 * 1e12 * c.compute_efficiency)
    assert tp2.compute == pytest.approx(dp2.compute + extra)
    vocab_split = step_time(m, Layout(tp=2, micro_batch=8), replace(t, tp_embeddings=True), c, 1)
    assert vocab_split.compute == pytest.approx(dp2.compute)


def test_bubble_and_step_time_add_up() -> None:
    m = Model(layers=32, hidden=4096, heads=32, vocab=51200, seq=2048)
    c = Cluster(4, 8, 80 * GB, 989e12, 450e9, 50e9)
    t = Training(global_batch=256)
    lay = Layout(dp_replicate=1, dp_shard=4, tp=2, pp=4, zero=1, micro_batch=2)
    microbatches = 256 // (2 * 4)
    st = step_time(m, lay, t, c, microbatches)
    assert st.bubble == pytest.approx(st.compute * 3 / microbatches)
    assert st.total == pytest.approx(st.compute + st.exposed_comm + st.bubble)  # mem_bw = 0
    fast = step_time(m, lay, t, replace(c, mem_bw=1e12), microbatches)
    # ZeRO-1: the update runs on this rank's shard, 28 bytes per parameter for Adam.
    assert fast.optimizer == pytest.approx(stage_params(m, lay, t) / 4 * 28 / 1e12)
    assert fast.total == pytest.approx(st.total + fast.optimizer)
    assert st.tp_comm > 0 and st.pp_comm > 0 and 0 <= st.dp_exposed <= st.dp_comm


def test_fused_attention_stores_no_scores() -> None:
    m = Model(layers=2, hidden=1024, heads=16, vocab=1000, seq=4096)
    fused = activation_bytes_per_layer(m, 1, 1, "none", fused=True)
    assert fused == activation_bytes_per_layer(m, 1, 1, "selective")
    assert fused < activation_bytes_per_layer(m, 1, 1, "none") / 3  # 34 vs 34 + 320


def test_tp_counts_separate_qkv_all_reduces_and_dtensor_dispatch() -> None:
    # meshrun's demo GPT has q, k, v as three layers: under TP each all-reduces its own input
    # gradient (24 all-reduces per step measured for its 4 blocks: 6 per block), and DTensor's
    # dispatch costs host time per TP linear layer and micro-batch.
    fused = Model(layers=4, hidden=256, heads=4, vocab=256, seq=128)
    separate = replace(fused, separate_qkv=True)
    assert (fused.tp_linears(), separate.tp_linears()) == (4, 6)
    assert replace(fused, gated_mlp=True).tp_linears() == 5
    c = Cluster(1, 2, 80 * GB, 1e12, 1e9, 1e9, comm_efficiency=1.0, intra_latency=1e-4)
    t = Training(global_batch=16, precision="fp32", sequence_parallel=False)
    lay = Layout(tp=2, micro_batch=8)
    one = all_reduce_time(2, 128 * 8 * 256 * 4, 1e9, 1e-4)
    base, more = step_time(fused, lay, t, c, 2), step_time(separate, lay, t, c, 2)
    assert base.tp_comm == pytest.approx(4 * one * 4 * 2)
    assert more.tp_comm == pytest.approx(6 * one * 4 * 2)
    assert base.tp_overhead == 0.0  # the default: a GPU's host dispatch runs ahead and hides
    slow = step_time(separate, lay, t, replace(c, tp_layer_overhead=2e-3), 2)
    assert slow.tp_overhead == pytest.approx(2e-3 * 6 * 4 * 2)
    assert slow.total == pytest.approx(more.total + slow.tp_overhead)
    no_tp = step_time(
        separate, Layout(dp_shard=2, micro_batch=8), t, replace(c, tp_layer_overhead=2e-3), 1
    )
    assert no_tp.tp_overhead == 0.0 and no_tp.tp_comm == 0.0


def test_fsdp2_per_unit_collective_overhead() -> None:
    # FSDP2 on a CPU waits at every unit's all-gather and reduce-scatter (no streams) and runs
    # its per-unit hooks: fsdp_unit_overhead per collective. The demo GPT's 4 blocks + root
    # and 2 micro-batches: ZeRO-3 gathers 5 + 4 per micro-batch, ZeRO-2 5, both scatter 5.
    m = Model(layers=4, hidden=256, heads=4, vocab=256, seq=128)
    t = Training(global_batch=32, precision="fp32")
    c = Cluster(1, 2, 80 * GB, 1e12, 1e9, 1e9, comm_efficiency=1.0, intra_latency=1e-4)
    slow = replace(c, fsdp_unit_overhead=2e-3)
    z2, z3 = Layout(dp_shard=2, zero=2, micro_batch=8), Layout(dp_shard=2, zero=3, micro_batch=8)
    assert fsdp_collectives(m, z3, 2) == (18, 5) and fsdp_collectives(m, z2, 2) == (10, 5)
    assert fsdp_collectives(m, Layout(dp_shard=2, micro_batch=8), 2) == (0, 0)
    for lay, calls in ((z3, 23), (z2, 15)):
        base, more = step_time(m, lay, t, c, 2), step_time(m, lay, t, slow, 2)
        assert base.fsdp_overhead == 0.0  # the default (GPUs): predictions unchanged
        assert more.fsdp_overhead == pytest.approx(2e-3 * calls)
        assert more.total == pytest.approx(base.total + 2e-3 * calls)
    ddp = step_time(m, Layout(dp_shard=2, micro_batch=8), t, slow, 2)
    one_shard = step_time(m, Layout(zero=3, micro_batch=8), t, slow, 4)
    assert ddp.fsdp_overhead == 0.0 and one_shard.fsdp_overhead == 0.0
