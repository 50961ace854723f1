"""benchmarks/gpu_check.py: its CPU smoke run (``--device cpu --tiny``: two ``meshrun launch``
worlds on Gloo) reports every check with a status and numbers, and one failing check is
recorded without stopping the others."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import scripts

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
# On CPU: plan_vs_fsdp2 compares the one-GPU prediction on world 1 only (the smoke run has
# two ranks), and NVML exists on CUDA only.
SKIPPED_ON_CPU = {"plan_vs_fsdp2", "nvml_metrics"}


def load_script() -> ModuleType:
    return scripts.load(SCRIPT, "gpu_check", register=True)  # for its dataclasses


@pytest.mark.timeout(900)
def test_cpu_smoke_run_reports_every_check(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=840)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    checks = {c["name"]: c for c in doc["checks"]}
    assert list(checks) == list(load_script().CHECKS)
    statuses = {name: c["status"] for name, c in checks.items()}
    assert {n for n, s in statuses.items() if s == "skip"} == SKIPPED_ON_CPU, statuses
    assert all(s == "pass" for n, s in statuses.items() if n not in SKIPPED_ON_CPU), checks
    for name, c in checks.items():
        assert c["targets"] == {}, name  # targets are the GPU's: none on CPU
        if name not in SKIPPED_ON_CPU and name != "environment":
            assert c["figures"], name
        assert all(isinstance(v, float) and math.isfinite(v) for v in c["figures"].values()), c
    figures = {name: c["figures"] for name, c in checks.items()}
    assert figures["nccl_init"]["world_size"] == 2
    assert figures["fsdp2_compile"]["tokens_per_s"] > 0 and figures["fsdp2_compile"]["mfu"] > 0
    assert figures["async_checkpoint"]["async2_blocked_s"] > 0
    assert figures["comm_timing"]["comm_s"] > 0
    assert figures["numerics_guard"]["weights_unchanged_by_skipped_step"] == 1
    assert figures["numerics_guard"]["nonfinite_events"] == 1
    assert figures["hang_watchdog"]["exit_code"] == 124
    assert figures["hang_watchdog"]["hang_reports"] >= 1
    md = (out / "gpu_check.md").read_text()
    assert all(f"| {name} | {c['status']} |" in md for name, c in checks.items())


def test_a_failing_check_is_recorded_and_the_next_one_runs() -> None:
    gc = load_script()
    results: list = []
    with gc.checking(results, "first") as res:
        res.figure("before_the_error", 3)
        raise RuntimeError("planted failure")
    with gc.checking(results, "second") as res:
        raise gc.Skip("not here")
    with gc.checking(results, "third") as res:
        res.figure("x", 1.5)
        res.target("x", 1.5, "<=", 1.0, cuda=True)
        res.target("y", 1.5, "<=", 1.0, cuda=False)  # not recorded off CUDA
    first, second, third = results
    assert (first.status, first.figures) == ("fail", {"before_the_error": 3.0})
    assert "RuntimeError: planted failure" in first.error
    assert (second.status, second.notes) == ("skip", ["not here"])
    assert third.status == "pass" and third.targets == {
        "x": {"value": 1.5, "op": "<=", "bound": 1.0, "met": False}
    }


def test_checks_a_world_never_reported_fail_with_the_launch_output(tmp_path: Path) -> None:
    gc = load_script()
    done = gc.Result("nccl_init", status="pass", figures={"world_size": 1.0})
    gc.write_results(tmp_path / "results.json", [done])
    results: list = []
    gc.collect(results, gc.WORLD_A, tmp_path / "results.json", 1, "the launcher's last words")
    assert [r.name for r in results] == list(gc.WORLD_A)
    assert results[0].status == "pass" and results[0].figures == {"world_size": 1.0}
    for r in results[1:]:
        assert r.status == "fail" and "exit 1" in r.error and "last words" in r.error
