"""SIGUSR1/SIGTERM save a checkpoint whatever checkpoint.interval is (docs/slurm.md), with
real `meshrun launch` processes on Gloo; and `meshrun slurm submit` warns only when the
signal would really stop the job unsaved (checkpoint.on_signal = false)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_signal_saves_and_exits_0_without_an_interval_or_resume(tmp_path: Path) -> None:
    script = ROOT / "tests" / "e2e" / "scripts" / "preempt_self_at_step3.py"
    args = [
        "launch",
        "--nproc-per-node",
        "2",
        str(script),
        "--checkpoint.interval=0",
        "--optim.steps=50",
        f"--job.run_dir={tmp_path}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "meshrun", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "preempted (SIGUSR1)" in out, out[-3000:]
    # The flag set after step 3 is agreed on at step 4's boundary: that step is saved, no more.
    assert (tmp_path / "checkpoints" / "step_00000004" / ".metadata").is_file()
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "event" not in r] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("flags", "warned"), [([], False), (["--checkpoint.on_signal=false"], True)]
)
def test_slurm_submit_warns_only_when_the_signal_would_not_save(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], warned: bool
) -> None:
    rc = main(
        [
            "slurm",
            "submit",
            "--dry-run",
            "--nodes",
            "1",
            "--time",
            "30",
            "-m",
            "meshrun.demo",
            "--steps",
            "5",
            f"--job.run_dir={tmp_path}/run",
            *flags,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    assert ("checkpoint.on_signal = false" in err) is warned, err
    assert "checkpoint.interval" not in err  # interval = 0 is no reason to warn
