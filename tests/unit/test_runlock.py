"""The run directory's lock (meshrun/runtime/runlock.py) between real processes: a holder in a child
process, a second taker here. No timing window: the child says "held" once it holds the lock
and keeps it until its stdin closes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from meshrun.runtime import runlock
from meshrun.runtime.runlock import LOCK_NAME, TOKEN_ENV, RunDirBusy, hold_run_dir

HOLDER = """
import sys
from meshrun.runtime.runlock import hold_run_dir
with hold_run_dir(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    sys.stdin.read()
"""


@contextmanager
def holder(run_dir: Path, token: str = "tok-a") -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), token],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.timeout(60)
def test_a_held_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    with holder(tmp_path) as proc:
        with pytest.raises(RunDirBusy) as err, hold_run_dir(tmp_path, "tok-b"):
            pass
        assert f"host {socket.gethostname()} pid {proc.pid}" in str(err.value)
        assert "--job.run_dir=DIR" in str(err.value)
        runlock.check_run_dir(tmp_path, "tok-a")  # the same job's other node: allowed
        with pytest.raises(RunDirBusy):
            runlock.check_run_dir(tmp_path, "tok-b")
        # rank 0 of the job whose launcher holds it passes; another job's does not
        runlock.rank0_lock(tmp_path, {TOKEN_ENV: "tok-a"})
        with pytest.raises(RunDirBusy):
            runlock.rank0_lock(tmp_path, {TOKEN_ENV: "tok-b"})
        with pytest.raises(RunDirBusy):
            runlock.rank0_lock(tmp_path, {})


@pytest.mark.timeout(60)
def test_a_dead_holders_lock_is_taken_over_with_a_line(tmp_path: Path) -> None:
    with holder(tmp_path) as proc:
        pid = proc.pid
    said: list[str] = []  # killed: its record stays, its lock went with it
    with hold_run_dir(tmp_path, "tok-b", say=said.append):
        assert os.environ[TOKEN_ENV] == "tok-b"
        assert str(os.getpid()) in (tmp_path / LOCK_NAME).read_text()
        with hold_run_dir(tmp_path, "tok-c"):  # nested in one process: the same hold
            pass
    assert (
        len(said) == 1
        and f"taking over the lock of host {socket.gethostname()} pid {pid}" in (said[0])
    )
    assert TOKEN_ENV not in os.environ and (tmp_path / LOCK_NAME).read_text() == ""
    with hold_run_dir(tmp_path, "tok-d", say=said.append):  # a clean end: nothing to say
        pass
    assert len(said) == 1


@pytest.mark.timeout(60)
def test_rank0_takes_the_lock_until_the_run_closes(tmp_path: Path) -> None:
    runlock.rank0_lock(tmp_path, {"TORCHELASTIC_RUN_ID": "job1"})
    try:
        proc = subprocess.run(
            [sys.executable, "-c", HOLDER, str(tmp_path), "tok"],
            input="",
            text=True,
            capture_output=True,
            timeout=30,
        )
        assert proc.returncode != 0 and "is in use by another job" in proc.stderr
    finally:
        runlock.release_rank0(tmp_path)
    with hold_run_dir(tmp_path, "tok"):
        pass


@pytest.mark.timeout(60)
def test_rank0_takes_a_free_lock_even_with_its_launchers_token(tmp_path: Path) -> None:
    """A replica group's own directory, or a restart after the rank 0 that held it died: the
    token alone is no lock, so rank 0 takes it."""
    runlock.rank0_lock(tmp_path, {TOKEN_ENV: "tok-a"})
    try:
        proc = subprocess.run(
            [sys.executable, "-c", HOLDER, str(tmp_path), "tok-b"],
            input="",
            text=True,
            capture_output=True,
            timeout=30,
        )
        assert proc.returncode != 0 and f"pid {os.getpid()}" in proc.stderr, proc.stderr
    finally:
        runlock.release_rank0(tmp_path)
