"""MoE routing in the planner (plan/moe.py's rank_load and dropped_fraction): balanced,
dropless with an imbalance factor, a capacity factor with drops; what each changes (the busiest
rank's expert compute, all-to-all and activations), the band `meshrun plan` prints, and the
hand-computed drops. Pure: no process group, no model built."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from meshrun.cli.main import main
from meshrun.plan.cost import Cluster, Layout, Model, Training, ep_comm, evaluate, step_time
from meshrun.plan.inputs import Moe, MoeRouting
from meshrun.plan.memory import activation_bytes
from meshrun.plan.moe import balanced, dropped_fraction, moe_model, rank_load, routed_flops

BASE = Model(4, 64, 4, 128, 32, ffn=128, gated_mlp=True)
TINY = moe_model(BASE, Moe(experts=8, top_k=2, expert_ffn=32))
GPU = Cluster(1, 8, 80e9, 1e15, intra_bw=100e9, inter_bw=10e9, comm_efficiency=1.0)
EP = Layout(dp_shard=8, ep=8, micro_batch=1)
T = Training(global_batch=8)


def routed(kind: str, imbalance: float = 1.0, capacity: float = 0.0) -> Model:
    assert TINY.moe is not None
    return replace(TINY, moe=replace(TINY.moe, routing=MoeRouting(kind, imbalance, capacity)))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("imbalance", "capacity", "dropped"),
    [
        (1.3, 1.0, 0.3**2 / 1.2),  # part of the spread 0.7..1.3 over 1.0
        (1.3, 1.3, 0.0),  # capacity at the busiest expert: nothing lost
        (1.0, 0.8, 0.2),  # balanced loads over a capacity below the mean
        (2.0, 0.5, 1.5**2 / 4.0),  # loads uniform on 0..2: the part above 0.5
        (1.2, 0.5, 0.5),  # every expert (0.8..1.2) over a capacity of 0.5: 1 - C
    ],
)
def test_dropped_fraction_by_hand(imbalance: float, capacity: float, dropped: float) -> None:
    assert dropped_fraction(MoeRouting("capacity", imbalance, capacity)) == pytest.approx(dropped)
    assert dropped_fraction(MoeRouting("dropless", imbalance)) == 0.0


def test_rank_load_with_and_without_expert_parallel() -> None:
    one = Layout(dp_shard=8)
    assert rank_load(routed("dropless", 1.5), EP) == 1.5
    assert rank_load(routed("dropless", 1.5), one) == 1.0  # every rank runs all experts
    assert rank_load(routed("capacity", 1.5, 1.2), EP) == 1.2  # capped by the capacity
    assert rank_load(routed("capacity", 1.5, 1.2), one) == pytest.approx(1 - 0.3**2 / 2.0)
    assert rank_load(TINY, EP) == 1.0


def test_dropless_imbalance_scales_the_busiest_ranks_experts_only() -> None:
    even, skew = routed("balanced"), routed("dropless", 1.5)
    a, b = step_time(even, EP, T, GPU, 8), step_time(skew, EP, T, GPU, 8)
    extra = (
        0.5
        * routed_flops(TINY, T.global_batch)
        / (GPU.world * GPU.peak_flops * GPU.compute_efficiency)
    )
    assert b.compute - a.compute == pytest.approx(extra, rel=1e-9)
    assert ep_comm(skew, EP, T, GPU, 8) == pytest.approx(1.5 * ep_comm(even, EP, T, GPU, 8))
    assert activation_bytes(skew, EP, T, 8) > activation_bytes(even, EP, T, 8)
    assert (a.dp_comm, a.pp_comm) == (b.dp_comm, b.pp_comm)  # the rest of the step is as it was


def test_evaluate_carries_the_band_and_the_drops() -> None:
    e = evaluate(routed("dropless", 1.5), EP, T, GPU)
    even = evaluate(balanced(routed("dropless", 1.5)), EP, T, GPU)
    assert e.balanced_tokens_per_s == pytest.approx(even.tokens_per_s)
    assert e.tokens_per_s < even.tokens_per_s and e.dropped == 0.0
    cap = evaluate(routed("capacity", 1.5, 1.0), EP, T, GPU)
    assert cap.dropped == pytest.approx(0.5**2 / 2.0)
    assert cap.tokens_per_s == pytest.approx(even.tokens_per_s)  # capped at the mean: as fast
    assert evaluate(TINY, EP, T, GPU).balanced_tokens_per_s == 0.0  # balanced: no band


SHAPE = "--layers 4 --hidden 64 --heads 4 --vocab 128 --seq 32 --ffn 128 --mlp gated"
MOE = "--experts 8 --top-k 2 --expert-ffn 32 --gpus-per-node 8 --global-batch 8"
ARGV = ["plan", *SHAPE.split(), *MOE.split(), "--layout", "dp_shard=8,ep=8,micro_batch=1"]


def test_meshrun_plan_prints_the_band_and_the_dropped_fraction(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*ARGV, "--moe-routing", "dropless", "--moe-imbalance", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "vs balanced" in out and "busiest expert at 1.5 x the mean" in out
    flags = ["--moe-routing", "capacity", "--moe-capacity-factor", "1", "--moe-imbalance", "1.5"]
    assert main([*ARGV, *flags]) == 0
    assert "12.5% of the routed tokens dropped" in capsys.readouterr().out
    assert main([*ARGV, *flags, "--json"]) == 0
    (layout,) = json.loads(capsys.readouterr().out)["layouts"]
    assert layout["dropped_fraction"] == pytest.approx(0.125)
    assert layout["balanced_tokens_per_s"] == pytest.approx(layout["tokens_per_s"])
    assert main(ARGV) == 0
    assert "routing: balanced" in capsys.readouterr().out


def test_a_measured_imbalance_is_read_from_a_runs_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"step": 1, "loss": 2.0}, {"step": 10, "moe_imbalance": 1.2}, {"moe_imbalance": 1.4}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{cut")
    assert main([*ARGV, "--moe-routing", "dropless", "--moe-imbalance", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "at 1.3 x the mean (the mean of 2 logged moe_imbalance figures in" in out
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert main([*ARGV, "--moe-routing", "dropless", "--moe-imbalance", str(tmp_path)]) == 2
    assert "has no moe_imbalance figure" in capsys.readouterr().err
