"""``meshrun launch --secret-file PATH``: a real one-node launch whose worker holds the key of
that file as ``MESHRUN_JOB_SECRET`` (and no ``RUN_DIR/job.secret`` is made); a file others can
read, or one that contradicts ``MESHRUN_JOB_SECRET``, stops the launch before any process is
spawned, naming the flag and the fix."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

# The worker writes the hash of the secret it was given (never the secret itself).
SCRIPT = """\
import hashlib, os, pathlib
key = os.environ.get("MESHRUN_JOB_SECRET", "")
pathlib.Path(os.environ["OUT"]).write_text(hashlib.sha256(key.encode()).hexdigest())
"""


def _launch(tmp: Path, secret_file: Path, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp / "show.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_JOB_SECRET")}
    argv = [
        sys.executable,
        "-m",
        "meshrun",
        "launch",
        "--nproc-per-node",
        "1",
        "--secret-file",
        str(secret_file),
        "--set",
        f"job.run_dir={tmp / 'run'}",
        str(script),
    ]
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=200,
        cwd=tmp,
        env={**base, "OMP_NUM_THREADS": "1", "OUT": str(tmp / "seen"), **env},
    )


def test_the_worker_gets_the_key_of_the_secret_file(tmp_path: Path) -> None:
    key = "4f" * 32
    secret = tmp_path / "job.key"
    secret.write_text(key + "\n")
    secret.chmod(0o600)
    done = _launch(tmp_path, secret)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "seen").read_text() == hashlib.sha256(key.encode()).hexdigest()
    assert not (tmp_path / "run" / "job.secret").exists()  # the file given is the secret
    assert key not in done.stdout + done.stderr


def test_a_readable_or_contradicted_secret_file_stops_before_anything_starts(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "job.key"
    secret.write_text("4f" * 32)
    secret.chmod(0o644)
    done = _launch(tmp_path, secret)
    assert done.returncode == 2
    assert f"the job secret --secret-file {secret} has mode 644" in done.stderr
    assert f"chmod 600 {secret}" in done.stderr
    secret.chmod(0o600)
    done = _launch(tmp_path, secret, MESHRUN_JOB_SECRET="a" * 64)
    assert done.returncode == 2
    assert "--secret-file" in done.stderr and "MESHRUN_JOB_SECRET are both set" in done.stderr
    assert not (tmp_path / "seen").exists()  # no worker ran
