"""Kill-and-resume of an expert-parallel run, for real: ``meshrun launch --max-restarts 1`` on 2
Gloo workers trains a tiny Qwen2-MoE at ``parallel.ep = 2`` (ZeRO-3, a checkpoint every 2
steps); rank 1 is SIGKILLed in step 5, the agent restarts the group, it resumes from step 4 and
finishes. Every loss logged after the resume and the final weights (experts gathered whole)
are bitwise those of an uninterrupted run of the same command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "scripts" / "ep_moe_train.py"
STEPS, KILL_AT = 8, 5


def launch(run_dir: Path, kill_at: int) -> tuple[dict[int, float], str]:
    cmd = [
        *(sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2"),
        *("--max-restarts", "1", str(SCRIPT), f"--job.run_dir={run_dir}"),
        *("--parallel.ep=2", "--parallel.zero=3", "--data.global_batch=8"),
        *("--data.micro_batch=4", f"--optim.steps={STEPS}", "--checkpoint.interval=2"),
        *("--metrics.progress=false", "--job.device=cpu"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL_AT_STEP": str(kill_at)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r and "event" not in r}
    return losses, proc.stderr


# heavy (CI's time): expert-parallel resume bitwise runs in CI in tests/dist/test_ep_checkpoint.py,
# killed runs resuming in test_resume_chaos.py
@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_ep_killed_run_resumes_bitwise(tmp_path: Path) -> None:
    ref, _ = launch(tmp_path / "ref", 0)
    got, log = launch(tmp_path / "killed", KILL_AT)
    assert "restart 1 of 1" in log, log[-3000:]
    assert "resumed from" in log and "step_00000004" in log, log[-3000:]
    assert sorted(ref) == list(range(1, STEPS + 1))
    for step in range(KILL_AT, STEPS + 1):
        assert got[step] == ref[step], (step, got[step], ref[step])
    a = torch.load(tmp_path / "ref" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    print(f"killed in step {KILL_AT}, resumed from step 4: steps {KILL_AT}-{STEPS} bitwise")
