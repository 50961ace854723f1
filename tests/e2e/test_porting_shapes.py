"""The three ported scripts of docs/porting.md ("Three other shapes of script") run: the plain
loop with its own argparse and scheduler, the Accelerate-style script with a transformers model
and dict batches, and the Trainer class whose dotted flags follow a ``--`` (that one under
``meshrun launch`` on 2 ranks). tests/unit/test_porting_doc.py keeps the doc's diffs equal to
these files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPTS = Path(__file__).parent / "scripts" / "porting"


def _run(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHRUN_", "PET_"))}
    done = subprocess.run(
        [sys.executable, *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_the_plain_loop_keeps_its_flags_schedule_and_epochs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = _run(
        tmp_path,
        str(SCRIPTS / "plain_loop.py"),
        f"--job.run_dir={run_dir}",
        "--data.micro_batch=4",
        "--optim.grad_clip=0.25",
        "--lr",
        "0.4",
        "--epochs",
        "2",
    ).stdout
    # 64 samples / global batch 4 = 16 steps an epoch; StepLR halves the LR after each.
    assert "step 16 lr 0.2000" in out and "step 32 lr 0.1000" in out
    assert "epoch 1 val" in out and "epoch 2 val" in out
    assert (run_dir / "checkpoints" / "step_00000032").is_dir()


def test_the_accelerate_shape_trains_evaluates_and_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        str(SCRIPTS / "accelerate_style.py"),
        f"--job.run_dir={run_dir}",
        "--data.micro_batch=4",
        "--data.global_batch=8",
        "--checkpoint.interval=3",
    ]
    out = _run(tmp_path, *args, "--optim.steps=3").stdout
    assert "step 3: perplexity" in out
    again = _run(tmp_path, *args, "--optim.steps=6")  # a restart continues at step 3
    assert "step 6: perplexity" in again.stdout and "resum" in again.stderr + again.stdout


def test_the_trainer_class_gets_its_dotted_flags_after_the_separator(tmp_path: Path) -> None:
    done = _run(
        tmp_path,
        "-m",
        "meshrun",
        "launch",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / "trainer_class.py"),
        f"--job.run_dir={tmp_path / 'run'}",
        "--data.micro_batch=2",
        "--data.global_batch=8",
        "--optim.lr=0.001",
        "--",
        "--model.width=8",
        "--trainer.max_iters=4",
    )
    (seen,) = [json.loads(s) for s in done.stdout.splitlines() if s.startswith('{"iters"')]
    assert seen == {"iters": [1, 2, 3, 4], "max_iters": 4, "width": 8, "lr": 0.001}
    assert "global batch 8 = micro 2 x accum 2 x dp 2" in done.stderr
