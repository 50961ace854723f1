"""Defaults that work at every size, in real processes: on 3 processes (neither a power of two
nor a divisor of the old default global batch 32) a plain torchrun script, the minimal meshrun
example and the demo start with the default config; the plain script also on 8 (the usual GPU
server). A script run without a launcher derives its global batch from its own world and says
where its run directory is. The sizes 6 and 8 of the demo and the example are checked without
processes in tests/unit/test_config_paths.py (the same resolution, `_prepare` and
`meshrun config show --world-size`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXAMPLE_TIMEOUT_S": "90", "COLUMNS": "100"}
    p = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def start_event(run_dir: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r.get("event") == "start")


@pytest.mark.timeout(200)
# heavy: [8]; [3] stays (an odd world size of the same script)
@pytest.mark.parametrize("nproc", [3, pytest.param(8, marks=pytest.mark.heavy)])
def test_a_plain_torchrun_script_starts_with_the_default_config(nproc: int, tmp_path: Path) -> None:
    script = str(ROOT / "examples" / "ddp_plain.py")  # no meshrun import at all
    p = run(["-m", "meshrun", "launch", "--nproc-per-node", str(nproc), script], tmp_path, 180)
    assert f"ok: {nproc} replicas identical" in p.stdout
    assert f"data.global_batch unset: 8 x {nproc} = {8 * nproc}" in p.stderr
    # The run directory it creates in the current directory is named, with how to move it.
    named = "the run writes its config, logs, metrics and checkpoints to runs/meshrun"
    assert f"meshrun launch: job.run_dir unset: {named} (in {tmp_path})" in p.stderr
    written = (tmp_path / "runs" / "meshrun" / "config.toml").read_text()
    assert f"global_batch = {8 * nproc}\n" in written  # the workers get the number


@pytest.mark.timeout(150)
def test_the_minimal_example_starts_on_three_processes(tmp_path: Path) -> None:
    script = str(ROOT / "examples" / "ddp_minimal.py")
    run_dir = tmp_path / "run"
    argv = [script, "--optim.steps=3", f"--job.run_dir={run_dir}"]
    p = run(["-m", "meshrun", "launch", "--nproc-per-node", "3", *argv], tmp_path, 130)
    assert "global batch 24 = micro 8 x accum 1 x dp 3" in p.stderr
    start = start_event(run_dir)
    assert (start["world_size"], start["global_batch"], start["accum"]) == (3, 24, 1)
    assert "job.run_dir unset" not in p.stderr  # it was set


@pytest.mark.timeout(150)
def test_the_demo_starts_on_three_processes_saying_what_changed(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    argv = ["--nproc", "3", "--size", "tiny", "--steps", "2", "--run-dir", str(run_dir)]
    p = run(["-m", "meshrun", "demo", *argv], tmp_path, 130)
    assert "meshrun demo: data.global_batch 32 -> 30, data.micro_batch 8 -> 5" in p.stderr
    start = start_event(run_dir)
    assert (start["global_batch"], start["micro_batch"], start["accum"]) == (30, 5, 2)
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2]


@pytest.mark.timeout(100)
def test_a_script_without_a_launcher_derives_from_its_own_world(tmp_path: Path) -> None:
    p = run([str(ROOT / "examples" / "ddp_minimal.py"), "--optim.steps=2"], tmp_path, 90)
    assert "global batch 8 (data.global_batch unset: micro_batch x dp) = micro 8" in p.stderr
    named = "this run writes its config, logs, metrics and checkpoints to runs/meshrun"
    assert f"job.run_dir unset: {named} (in {tmp_path}); set --job.run_dir=DIR" in p.stderr
    run_dir = tmp_path / "runs" / "meshrun"
    assert start_event(run_dir)["global_batch"] == 8  # never 0 downstream
    assert "global_batch = 8\n" in (run_dir / "config.toml").read_text()
