"""The calibration path: nccl-tests bandwidth formulas, the file bench writes, plan reading it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshrun.cli.main import main
from meshrun.diagnose.calibration import (
    bus_bandwidth,
    calibration,
    fit_collectives,
    message_sizes,
    pairs_report,
    slow_pairs,
    write_calibration,
)


def test_bus_bandwidth_follows_nccl_tests() -> None:
    # 1 GB in 1 s on 8 ranks: algbw 1 GB/s; busbw x 2*7/8 (all-reduce), x 7/8 (gather/scatter).
    assert bus_bandwidth("all_reduce", 1e9, 1.0, 8) == (1e9, pytest.approx(1.75e9))
    assert bus_bandwidth("all_gather", 1e9, 1.0, 8)[1] == pytest.approx(0.875e9)
    assert bus_bandwidth("reduce_scatter", 1e9, 2.0, 8)[1] == pytest.approx(0.4375e9)
    assert bus_bandwidth("send_recv", 1e9, 1.0, 8)[1] == pytest.approx(1e9)
    assert message_sizes(2**20) == [4096, 16384, 65536, 262144, 1048576]


def _row(op: str, size: int, steps: int, busbw: float) -> dict[str, object]:
    # 2 ranks, 0.25 ms per ring step: t = steps * alpha + steps/2 * size / busbw
    t = steps * 0.25e-3 + steps / 2 * size / busbw
    return {"op": op, "bytes": size, "time_s": t, "algbw": size / t, "busbw": steps / 2 * size / t}


MEASURED = {
    "compute": {"matmul_flops": 40e9, "model_flops": 20e9},
    "comm": [
        _row("all_reduce", 4096, 2, 5e8),
        _row("all_reduce", 2**20, 2, 5e8),
        _row("all_gather", 2**20, 1, 2e8),
    ],
}


def test_calibration_maps_measurements_to_the_planner_rates(tmp_path: Path) -> None:
    cpu = SimpleNamespace(type="cpu")
    rates = calibration(MEASURED, 2, cpu)
    assert rates["peak_flops"] == 40e9 and rates["compute_efficiency"] == 0.5
    # The alpha-beta fit: all-reduce bus bandwidth, latency per ring step, all-gather's ratio.
    assert rates["intra_bw"] == rates["inter_bw"] == pytest.approx(5e8)
    assert rates["intra_latency"] == pytest.approx(0.25e-3)
    assert rates["all_gather_ratio"] == pytest.approx(0.4)
    assert rates["comm_efficiency"] == 1.0 and rates["memory_bytes"] > 0
    assert rates["overlap"] == 0.0  # CPU: Gloo's collectives share the cores with the math
    assert "tp_layer_overhead" not in rates  # not measured: the planner's default stays
    tp = {"tp_layer_overhead": 0.0, "tp_stack_s": 1e-3, "local_stack_s": 1e-3}
    assert calibration({**MEASURED, "tp": tp}, 2, cpu)["tp_layer_overhead"] == 0.0
    with_tp = {**MEASURED, "tp": {**tp, "tp_layer_overhead": 1e-3}}
    assert "tp_layer_overhead" not in calibration(with_tp, 2, SimpleNamespace(type="meta"))
    # bench_fsdp's per-collective cost: carried on a CPU only (GPU streams hide it).
    fsdp = {"fsdp_unit_overhead": 4e-3, "fsdp_stack_s": 0.2, "local_stack_s": 0.1}
    assert calibration({**MEASURED, "fsdp": fsdp}, 2, cpu)["fsdp_unit_overhead"] == 4e-3
    assert "fsdp_unit_overhead" not in rates
    assert "fsdp_unit_overhead" not in calibration(
        {**MEASURED, "fsdp": fsdp}, 2, SimpleNamespace(type="meta")
    )
    path = tmp_path / "cal.json"
    write_calibration(str(path), {"compute": MEASURED["compute"]}, 2, cpu)
    write_calibration(str(path), {"comm": MEASURED["comm"]}, 2, cpu)  # merges, not replaces
    doc = json.loads(path.read_text())
    assert set(doc["measured"]) == {"compute", "comm"}
    assert doc["cluster"]["peak_flops"] == 40e9 and doc["cluster"]["intra_bw"] == pytest.approx(5e8)


def test_plan_uses_the_calibration_and_flags_win(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "cal.json"
    write_calibration(str(path), MEASURED, 2, SimpleNamespace(type="cpu"))
    shape = [
        "--layers",
        "4",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--vocab",
        "256",
        "--seq",
        "128",
        "--gpus-per-node",
        "2",
        "--global-batch",
        "16",
        "--json",
    ]
    assert main(["plan", *shape, "--calibration", str(path), "--overlap", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cluster"]["peak_flops"] == 40e9 and doc["cluster"]["compute_efficiency"] == 0.5
    assert doc["cluster"]["intra_bw"] == pytest.approx(5e8) and doc["cluster"]["overlap"] == 0.0
    ddp = [lay for lay in doc["layouts"] if lay["zero"] == 0 and lay["tp"] == 1]
    for lay in ddp:  # compute at 20 GFLOP/s per rank, all-reduce of 2P bytes at 0.5 GB/s
        assert lay["step_time_breakdown_s"]["compute"] == pytest.approx(
            72 * 16 * 128 * 4 * 256**2 * (1 + 128 / (6 * 256) + 256 / (16 * 4 * 256)) / 2 / 20e9
        )


def test_plan_reads_the_measured_tp_dispatch_cost(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "cal.json"
    for per_layer in (0.0, 1e-3):  # 0 (nothing measured above the all-reduces) is allowed
        tp = {"tp_layer_overhead": per_layer, "tp_stack_s": 1e-2, "local_stack_s": 1e-3}
        write_calibration(str(path), {**MEASURED, "tp": tp}, 2, SimpleNamespace(type="cpu"))
        shape = [
            "--layers",
            "4",
            "--hidden",
            "256",
            "--heads",
            "4",
            "--vocab",
            "256",
            "--seq",
            "128",
            "--gpus-per-node",
            "2",
            "--global-batch",
            "16",
            "--json",
            "--top",
            "0",
            "--layout",
            "tp=2,micro_batch=8",
        ]
        assert main(["plan", *shape, "--calibration", str(path)]) == 0
        lay = json.loads(capsys.readouterr().out)["layouts"][0]
        # 4 TP linear layers per block (fused qkv, plain MLP) x 4 blocks x 2 micro-batches
        assert lay["step_time_breakdown_s"]["tp_overhead"] == pytest.approx(per_layer * 32)


def test_plan_reads_the_measured_fsdp_unit_cost(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "cal.json"
    fsdp = {"fsdp_unit_overhead": 4e-3, "fsdp_stack_s": 0.2, "local_stack_s": 0.1}
    write_calibration(str(path), {**MEASURED, "fsdp": fsdp}, 2, SimpleNamespace(type="cpu"))
    shape = [
        "--layers",
        "4",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--vocab",
        "256",
        "--seq",
        "128",
        "--gpus-per-node",
        "2",
        "--global-batch",
        "32",
        "--json",
        "--top",
        "0",
    ]
    for layout, calls in (("zero=3", 18 + 5), ("zero=2", 10 + 5), ("zero=0", 0)):
        lay_arg = ["--layout", f"dp_shard=2,{layout},micro_batch=8"]
        assert main(["plan", *shape, *lay_arg, "--calibration", str(path)]) == 0
        lay = json.loads(capsys.readouterr().out)["layouts"][0]
        # 4 blocks + root, 2 micro-batches: ZeRO-3 gathers 9 per micro-batch, ZeRO-2 5; 5 RS
        assert lay["step_time_breakdown_s"]["fsdp_overhead"] == pytest.approx(4e-3 * calls)


def test_bad_calibration_files_are_rejected(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"peak_flop": 1.0}))
    assert main(["plan", "--params", "1e9", "--calibration", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown keys ['peak_flop']" in err and "peak_flops" in err
    assert main(["plan", "--params", "1e9", "--calibration", str(tmp_path / "none.json")]) == 2
    assert "meshrun bench" in capsys.readouterr().err


def test_alpha_beta_fit_recovers_latency_and_per_op_bandwidths() -> None:
    # Synthetic Gloo-like rates on 4 ranks: 50 us per ring step, all-reduce bus bandwidth
    # 1 GB/s, all-gather 0.5 GB/s, reduce-scatter 0.25 GB/s.
    n, alpha, rates = 4, 50e-6, {"all_reduce": 1e9, "all_gather": 0.5e9, "reduce_scatter": 0.25e9}
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}
    rows = []
    for op, bw in rates.items():
        for size in message_sizes(16 * 2**20):
            t = steps[op] * alpha + size * steps[op] / n / bw
            rows.append({"op": op, "bytes": size, "time_s": t, "busbw": size / t})
    fit = fit_collectives(rows, n)
    assert fit["latency"] == pytest.approx(alpha, rel=1e-6)
    for op, bw in rates.items():
        assert fit[op] == pytest.approx(bw, rel=1e-6)
    rates_out = calibration({"comm": rows}, n, SimpleNamespace(type="cpu"))
    assert rates_out["intra_latency"] == pytest.approx(alpha, rel=1e-6)
    assert rates_out["all_gather_ratio"] == pytest.approx(0.5)
    assert rates_out["reduce_scatter_ratio"] == pytest.approx(0.25)


def test_slow_link_is_named_in_the_pair_matrix() -> None:
    bw = [[0, 1e9, 1e9, 1e9], [1e9, 0, 1e9, 0.2e9], [1e9, 1e9, 0, 1e9], [1e9, 0.2e9, 1e9, 0]]
    assert slow_pairs(bw) == [(1, 3)]
    lines = pairs_report({"labels": ["a", "b", "c", "d"], "bytes": 2**22, "bw": bw})
    assert "4 MiB each way" in lines[0] and lines[3].split()[:2] == ["b", "1.000"]
    assert lines[-1] == "slow link: b <-> d at 0.200 GB/s, 0.20x the median of all pairs"
    even = pairs_report({"labels": ["a", "b"], "bytes": 2**20, "bw": [[0, 1e9], [1e9, 0]]})
    assert even[-1].startswith("no slow link")
