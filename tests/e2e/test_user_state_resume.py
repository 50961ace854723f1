"""Kill and resume with the user's own state, for real: ``meshrun launch --max-restarts 1`` on 2
Gloo workers runs tests/e2e/scripts/user_state_lstm.py (an LSTM with dropout and a hidden state
carried per rank, the user's own LambdaLR stepped after ``run.optimizer_step``, checkpoints
every 4 steps); rank 1 SIGKILLs itself after step 6, the job restarts and resumes from step 4.
Every step's loss and LR and every rank's hidden state must then be bitwise those of an
uninterrupted run, steps 5 and 6 included (trained twice).

Before: the scheduler came back one step behind (saved inside ``run.optimizer_step``, before
the user's ``sched.step()``), and ``run.resume`` took no per-rank objects (by name, rank 1's
hidden state was rank 0's after the resume).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "user_state_lstm.py"
STEPS = 12
KILL_AT = 6


def launch(run_dir: Path, kill_at: int) -> str:
    records = run_dir / "records"
    records.mkdir(parents=True)
    argv = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2"]
    argv += ["--max-restarts", "1", str(SCRIPT), f"--job.run_dir={run_dir}"]
    argv += ["--data.global_batch=8", "--data.micro_batch=4", f"--optim.steps={STEPS}"]
    argv += ["--checkpoint.interval=4", "--metrics.progress=false", "--job.timeout_s=30"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RECORD_DIR": str(records)}
    env["KILL_AT"] = str(kill_at)
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=280, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    return out


def by_step(run_dir: Path, rank: int) -> dict[int, dict[str, str]]:
    """The last record of each step (a step trained again after the resume replaces it)."""
    rows = (run_dir / "records" / f"rank_{rank}.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, rows)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_rank_resumes_scheduler_and_per_rank_state_bitwise(tmp_path: Path) -> None:
    launch(tmp_path / "straight", kill_at=0)
    out = launch(tmp_path / "killed", kill_at=KILL_AT)
    assert (tmp_path / "killed" / "records" / "killed").exists()
    assert "resumed from" in out and "(step 4," in out, out[-4000:]
    straight = [by_step(tmp_path / "straight", r) for r in (0, 1)]
    killed = [by_step(tmp_path / "killed", r) for r in (0, 1)]
    assert sorted(straight[0]) == list(range(1, STEPS + 1))
    # The hidden state is each rank's own (else per_rank proves nothing).
    assert straight[0][STEPS]["hidden"] != straight[1][STEPS]["hidden"]
    for rank in (0, 1):
        differ = [s for s in straight[rank] if killed[rank].get(s) != straight[rank][s]]
        assert not differ, (
            f"rank {rank}: steps {differ} differ, e.g. straight {straight[rank][differ[0]]} "
            f"vs resumed {killed[rank].get(differ[0])}"
        )
