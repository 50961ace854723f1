"""A refusal raised in the workers reaches the user as its message, not as tracebacks: a
tensor-parallel plan that breaks the model's forward (attention reshaped by the global head
count, ``compare_transformer.py --heads global``) under ``meshrun launch --parallel.tp=2``.
Each rank that gets to print says one line; the launcher's summary says the rank refused the
run and shows the whole message, the fix included; the traceback stays in the error file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).parent / "scripts" / "compare_transformer.py"


def test_a_tp_plan_that_breaks_the_forward_is_one_refusal_not_a_traceback(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", str(SCRIPT)]
    argv += ["--heads", "global", "--parallel.tp=2", f"--job.run_dir={tmp_path / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=150)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    said = [x for x in out.splitlines() if "error: ConfigError: tensor parallel over 2" in x]
    assert said and all(x.split(":", 1)[1].startswith("meshrun rank ") for x in said), said
    summary = out[out.index("refused the run (host ") :]
    flat = " ".join(summary.split())
    assert "breaks the forward of layers.0.attn" in flat, summary
    assert "reshape by the local width: -1 in place of the head count" in flat, summary
    assert flat.split("error : ", 1)[1].split(" where : ")[0].endswith("or set parallel.tp=1")
    error_file = summary.split("traceback: in ", 1)[1].split()[0]
    assert "Traceback (most recent call last)" in Path(error_file).read_text()
