"""One job per run directory, through real launches (meshrun/runtime/runlock.py).

A first ``meshrun launch`` trains 2 Gloo workers and pauses after step 3 (it has written its
config, metrics and a checkpoint) until the test says go. While it waits, a second
``meshrun launch`` and a plain ``torchrun`` of a ``meshrun.init()`` script on the same run
directory are refused, naming the first launcher's host and PID; then the first job finishes,
its config, metrics and checkpoints its own. A launcher killed alone leaves the directory busy
while its workers live; a job killed whole with SIGKILL leaves its lock, which the next launch
takes over with a line naming the dead holder.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _dist import free_port

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "scripts" / "train_until_go.py"


def _argv(run_dir: Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "meshrun",
        "launch",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        f"--job.run_dir={run_dir}",
        f"--optim.steps={steps}",
        "--checkpoint.interval=3",
        "--data.global_batch=8",
        "--data.micro_batch=4",
        "--metrics.progress=false",
        "--job.timeout_s=60",
    ]


def _env(tmp: Path, pause_at: int) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PAUSE_AT": str(pause_at)}
    return env | {"PAUSED": str(tmp / "paused"), "GO": str(tmp / "go")}


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the first job ended early: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def _started(proc_out: str) -> list[dict[str, object]]:
    return [json.loads(x) for x in proc_out.splitlines() if '"event": "start"' in x]


@pytest.mark.timeout(420)
def test_a_second_job_on_a_busy_run_dir_is_refused_and_the_first_is_unaffected(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    first = subprocess.Popen(
        _argv(run, 6),
        env=_env(tmp_path, 3),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_for(tmp_path / "paused", first)
        config = (run / "config.toml").read_bytes()
        second = subprocess.run(
            _argv(run, 9), env=_env(tmp_path, 0), text=True, capture_output=True, timeout=120
        )
        host, pid = socket.gethostname(), first.pid
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"run directory {run} is in use by another job: host {host} pid {pid}" in (
            second.stderr
        )
        assert "--job.run_dir=DIR" in second.stderr and "Traceback" not in second.stderr
        assert "rendezvous" not in second.stderr  # refused before the agent started
        plain = _plain_torchrun(run, tmp_path)
        assert plain.returncode != 0
        assert f"is in use by another job: host {host} pid {pid}" in plain.stdout, plain.stdout
        # One line per rank, no worker traceback (torchrun's own summary still follows).
        refusals = [x for x in plain.stdout.splitlines() if "is in use by another job" in x]
        assert sorted(x.split(":")[0] for x in refusals) == ["meshrun rank 0", "meshrun rank 1"]
        assert "runlock.py" not in plain.stdout, plain.stdout
        assert (run / "config.toml").read_bytes() == config  # nothing of theirs written
        (tmp_path / "go").touch()
        out, _ = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0, out[-3000:]
    metrics = (run / "metrics.jsonl").read_text()
    assert len(_started(metrics)) == 1  # one job started in this directory
    steps = [json.loads(x)["step"] for x in metrics.splitlines() if '"loss"' in x]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step")) == [
        "step_00000003",
        "step_00000006",
    ]
    assert (run / "meshrun.lock").read_text() == ""  # released: the next job takes it quietly


def _plain_torchrun(run: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    """torchrun itself (no meshrun launcher): its rank 0 finds the directory busy in
    meshrun.init(), and every rank stops with the message."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    argv += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT)]
    argv += _argv(run, 9)[7:]
    env = {k: v for k, v in _env(tmp, 0).items() if k != "MESHRUN_RUN_LOCK"}
    return subprocess.run(
        argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=180
    )


@pytest.mark.timeout(420)
def test_a_killed_launcher_leaves_the_run_dir_busy_while_its_workers_live_then_taken_over(
    tmp_path: Path,
) -> None:
    """The lock of ``meshrun launch`` ends with the launcher; its workers share a second one
    for their lives, so a SIGKILL of the launcher alone no longer frees the directory. Once
    the workers are SIGKILLed too (the whole job killed, no clean-up), the next launch takes
    the stale lock over with a line naming the dead holder. One first job serves both."""
    import sockets

    run = tmp_path / "run"
    first = subprocess.Popen(
        _argv(run, 6),
        env=_env(tmp_path, 3),
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    workers: list[int] = []
    try:
        _wait_for(tmp_path / "paused", first)
        held = json.loads((run / "meshrun.lock").read_text())
        assert held["pid"] == first.pid and held["host"] == socket.gethostname()
        workers = [p for p in sockets.tree(first.pid) if p != first.pid]
        # The launcher's orphan guard would end the workers GRACE_S after the launcher dies
        # (tests/e2e/test_launch_orphans.py shows that): held stopped, it leaves them running
        # for as long as this check takes, with no window to race.
        guards = [p for p in workers if "orphans.py" in _cmdline(p)]
        assert len(guards) == 1, [_cmdline(p) for p in workers]
        os.kill(guards[0], signal.SIGSTOP)
        os.kill(first.pid, signal.SIGKILL)  # the launcher only
        first.wait(30)
        alive = [p for p in workers if p not in guards and Path(f"/proc/{p}").exists()]
        assert alive, "the workers ended with their launcher: nothing to check here"
        second = subprocess.run(
            _argv(run, 6), env=_env(tmp_path, 0), text=True, capture_output=True, timeout=120
        )
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"run directory {run} is in use by another job: its workers still run" in (
            second.stderr
        ), second.stderr[-3000:]
        assert "Traceback" not in second.stderr and "rendezvous" not in second.stderr
    finally:
        _kill_and_wait([first.pid, *workers])  # the rest of the job, no clean-up either
    again = subprocess.run(
        _argv(run, 6), env=_env(tmp_path, 0), text=True, capture_output=True, timeout=240
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"taking over the lock of host {socket.gethostname()} pid {first.pid}" in again.stderr


def _kill_and_wait(pids: list[int], timeout_s: float = 60) -> None:
    """SIGKILL ``pids`` and wait until each has exited (gone, or a zombie: its locks freed)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while _running(pid):
            assert time.monotonic() < deadline, f"pid {pid} still runs after SIGKILL"
            time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
