"""The demo runs under FSDP 2 x TP 2 through command-line overrides, the way a user runs it:
`meshrun demo --nproc 4 --parallel.dp_shard=2 --parallel.tp=2 --steps 3 --size tiny`, with
loss parallel (the demo computes its loss inside ``run.loss_parallel()``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(240)
def test_demo_runs_fsdp2_x_tp2_from_overrides(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "MESHRUN_CONFIG"}
    args = ["--nproc", "4", "--parallel.dp_shard=2", "--parallel.tp=2", "--steps", "3"]
    args += ["--parallel.loss_parallel=true"]  # the head split over the vocabulary too
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshrun",
            "demo",
            *args,
            "--size",
            "tiny",
            "--run-dir",
            str(run_dir),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "mesh dp_shard=2 x tp=2" in out
    assert "tensor parallel over 2 ranks: 13 modules split (+ loss parallel)" in out
    assert "FSDP2 ZeRO-3 over pp=1 x dp_replicate=1 x dp_shard=2 x tp=2" in out
    # Placement: tp pairs neighbouring ranks (inside a node), dp_shard strides over them.
    assert "rank groups: dp_shard: [0, 2] [1, 3] | tp: [0, 1] [2, 3]" in out
    # Block matmuls and (loss parallel) the head over 4 ranks, embeddings and norms over 2.
    assert "this rank holds 0.15 MiB of 0.51 MiB parameters" in out
    # After the first step, every rank's measured bytes: the same split on each of the 4 ranks,
    # gradients as the parameters, AdamW's two buffers twice the parameters (2-digit MiB).
    table = out[out.index("model state per rank after the first step") :].splitlines()[2:6]
    cells = [line.split()[-5:] for line in table]  # after the launcher's "[default0]:" prefix
    assert [c[0] for c in cells] == ["0", "1", "2", "3"], table
    for c in cells:
        params, grads, optim = (float(x) for x in c[-3:])
        assert params == 0.15 and grads == params and abs(optim - 2 * params) <= 0.02, table
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "step" in r]
    assert len(losses) == 3 and all(5.0 < x < 6.0 for x in losses), losses  # ~ln(256) at start
    warned = (run_dir / "logs" / "rank0.log").read_text()
    assert "parallel.zero = 0 (DDP) cannot take tensor-parallel parameters" in warned
    assert (run_dir / "checkpoints" / "step_00000003").is_dir()
