"""The calibration path: nccl-tests bandwidth formulas, the file bench writes, plan reading it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshrun.cli import main
from meshrun.diagnose.bench import bus_bandwidth, calibration, message_sizes, write_calibration


def test_bus_bandwidth_follows_nccl_tests() -> None:
    # 1 GB in 1 s on 8 ranks: algbw 1 GB/s; busbw x 2*7/8 (all-reduce), x 7/8 (gather/scatter).
    assert bus_bandwidth("all_reduce", 1e9, 1.0, 8) == (1e9, pytest.approx(1.75e9))
    assert bus_bandwidth("all_gather", 1e9, 1.0, 8)[1] == pytest.approx(0.875e9)
    assert bus_bandwidth("reduce_scatter", 1e9, 2.0, 8)[1] == pytest.approx(0.4375e9)
    assert bus_bandwidth("send_recv", 1e9, 1.0, 8)[1] == pytest.approx(1e9)
    assert message_sizes(2**20) == [4096, 16384, 65536, 262144, 1048576]


MEASURED = {
    "compute": {"matmul_flops": 40e9, "model_flops": 20e9},
    "comm": [
        {"op": "all_reduce", "bytes": 4096, "time_s": 1e-3, "algbw": 4e6, "busbw": 4e6},
        {"op": "all_reduce", "bytes": 2**20, "time_s": 2e-3, "algbw": 5e8, "busbw": 5e8},
        {"op": "all_gather", "bytes": 2**20, "time_s": 2e-3, "algbw": 5e8, "busbw": 2e8},
    ],
}


def test_calibration_maps_measurements_to_the_planner_rates(tmp_path: Path) -> None:
    cpu = SimpleNamespace(type="cpu")
    rates = calibration(MEASURED, 2, cpu)
    assert rates["peak_flops"] == 40e9 and rates["compute_efficiency"] == 0.5
    assert rates["intra_bw"] == rates["inter_bw"] == 5e8  # the largest all-reduce's busbw
    assert rates["comm_efficiency"] == 1.0 and rates["memory_bytes"] > 0
    assert rates["overlap"] == 0.0  # CPU: Gloo's collectives share the cores with the math
    path = tmp_path / "cal.json"
    write_calibration(str(path), {"compute": MEASURED["compute"]}, 2, cpu)
    write_calibration(str(path), {"comm": MEASURED["comm"]}, 2, cpu)  # merges, not replaces
    doc = json.loads(path.read_text())
    assert set(doc["measured"]) == {"compute", "comm"}
    assert doc["cluster"]["peak_flops"] == 40e9 and doc["cluster"]["intra_bw"] == 5e8


def test_plan_uses_the_calibration_and_flags_win(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "cal.json"
    write_calibration(str(path), MEASURED, 2, SimpleNamespace(type="cpu"))
    shape = ["--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "256", "--seq", "128",
             "--gpus-per-node", "2", "--global-batch", "16", "--json"]  # fmt: skip
    assert main(["plan", *shape, "--calibration", str(path), "--overlap", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cluster"]["peak_flops"] == 40e9 and doc["cluster"]["compute_efficiency"] == 0.5
    assert doc["cluster"]["intra_bw"] == 5e8 and doc["cluster"]["overlap"] == 0.0
    ddp = [lay for lay in doc["layouts"] if lay["zero"] == 0 and lay["tp"] == 1]
    for lay in ddp:  # compute at 20 GFLOP/s per rank, all-reduce of 2P bytes at 0.5 GB/s
        assert lay["step_time_breakdown_s"]["compute"] == pytest.approx(
            72 * 16 * 128 * 4 * 256**2 * (1 + 128 / (6 * 256) + 256 / (16 * 4 * 256)) / 2 / 20e9
        )


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
