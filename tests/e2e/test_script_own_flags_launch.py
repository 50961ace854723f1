"""``meshrun launch ... train.py [overrides] -- --trainer.batch_size=4``: a script's own dotted
flags reach every worker as written while meshrun's overrides before the ``--`` still apply
(the pure side and the plain ``python`` run are tests/unit/test_script_own_flags.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).parent / "scripts" / "dotted_own_flags.py"
OWN = ["--trainer.batch_size=4", "--model.n_layer", "3"]


def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHRUN_", "PET_"))}
    argv = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", *args]
    return subprocess.run(
        argv,
        cwd=tmp_path,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=200,
    )


def test_launch_passes_the_scripts_dotted_flags_after_the_separator(tmp_path: Path) -> None:
    run_dir = f"--job.run_dir={tmp_path / 'run'}"
    done = _launch(tmp_path, str(SCRIPT), run_dir, "--optim.lr=0.25", "--", *OWN)
    assert done.returncode == 0, done.stderr
    seen = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(s["rank"] for s in seen) == [0, 1]
    for s in seen:
        assert s["argv"] == OWN
        assert (s["batch_size"], s["n_layer"], s["lr"]) == (4, 3, 0.25)


def test_launch_refuses_them_without_the_separator_and_says_where_they_go(
    tmp_path: Path,
) -> None:
    done = _launch(tmp_path, str(SCRIPT), f"--job.run_dir={tmp_path / 'run'}", *OWN)
    assert done.returncode == 2
    assert "unknown config section 'trainer'" in done.stderr
    assert "put it after `--`" in done.stderr
    assert not (tmp_path / "run").exists()  # refused before any process started
