"""`meshrun compare` end to end: a user's script (tests/e2e/scripts/compare_classifier.py)
run on one process and under ZeRO-3 on 2 Gloo processes through `meshrun launch`: a correct
loss agrees (exit 0), a summed loss is caught at step 1 with the parameters named (exit 1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "compare_classifier.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _compare(out: Path, *script_args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHRUN_", "PET_"))}
    argv = ["compare", "--nproc", "2", "--steps", "3", "--layout", "zero=3", "--out", str(out)]
    return subprocess.run(
        [sys.executable, "-m", "meshrun", *argv, str(SCRIPT), *script_args],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=400,
        check=False,
    )


def test_compare_agrees_on_a_correct_loss_and_catches_a_summed_one(tmp_path: Path) -> None:
    ok = _compare(tmp_path / "mean")
    assert ok.returncode == 0, ok.stdout + ok.stderr[-3000:]
    assert "layout zero=3: agrees" in ok.stdout
    records = sorted(p.name for p in (tmp_path / "mean" / "1-zero-3" / "record").iterdir())
    assert records == [f"step0000{k}-rank00000.safetensors" for k in (1, 2, 3)]

    summed = _compare(tmp_path / "sum", "--reduction", "sum")
    assert summed.returncode == 1, summed.stdout + summed.stderr[-3000:]
    out = summed.stdout
    assert "layout zero=3: DIFFERS from step 1" in out
    # The loss is the micro-batch's sum: one process's batch is twice each rank's.
    assert "parameters differing most at step 1" in out
    assert "head.weight" in out and "gradient 5.0e-01" in out
