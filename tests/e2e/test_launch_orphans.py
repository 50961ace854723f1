"""A SIGKILLed ``meshrun launch`` takes its workers with it (launch/agent/orphans.py, Linux).

torch elastic starts each worker in its own session, so before the guard a ``kill -9`` of the
launcher (or of its process group) left them running. First the guard alone, under a small
launcher of our own that starts ``sleep`` processes (no torch: fractions of a second), then
two real launches: a plain script whose group is restarted once before the kill, and a meshrun
script, which saves its preemption checkpoint on the guard's SIGTERM.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from meshrun.launch.agent.orphans import TOKEN_ENV, job_processes, signal_job

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")
SCRIPTS = Path(__file__).parent / "scripts"
DEADLINE_S = 60.0  # generous on a loaded 2-core machine: the grace is 10 s (2 s below)

# A launcher of our own: its "workers" are sleeps in sessions of their own, as torch starts
# them; one ignores SIGTERM (the guard must SIGKILL it). It prints the PIDs, then waits to be
# killed ("hang"), stops its workers and returns through the guard ("normal"), or returns
# with them running ("leftover"). SIGTERM is ignored from before the exec (the disposition
# survives it), not by a shell's `trap`: a SIGTERM that came before the shell ran its trap
# would end that worker at the first signal.
FAKE_LAUNCHER = """
import os, signal, subprocess, sys, time
from meshrun.launch.agent.orphans import TOKEN_ENV, orphan_guard
def ignore_term():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with orphan_guard(grace_s=2.0):
    kids = [subprocess.Popen(["sleep", "300"], start_new_session=True),
            subprocess.Popen(["sleep", "301"], start_new_session=True, preexec_fn=ignore_term)]
    print("token", os.environ[TOKEN_ENV], "pids", *[k.pid for k in kids], flush=True)
    if sys.argv[1] == "hang":
        time.sleep(300)
    if sys.argv[1] == "leftover":  # return with both running: the guard's exit ends them
        sys.exit(0)
    for k in kids:
        k.kill()
        k.wait()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent has not reaped it


def _wait_gone(pids: Iterable[int], deadline_s: float = DEADLINE_S) -> list[int]:
    """The PIDs still running after ``deadline_s`` (polling /proc: no timing is asserted)."""
    pids = list(pids)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _guards(token: str) -> list[int]:
    """The guard process of ``token`` (its command line holds the token)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if token.encode() in cmdline.read_bytes() and b"orphans.py" in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _start_fake(mode: str) -> tuple[subprocess.Popen[str], str, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_LAUNCHER, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    fields = proc.stdout.readline().split()
    assert fields[:1] == ["token"], proc.communicate(timeout=30)
    return proc, fields[1], [int(p) for p in fields[3:]]


@pytest.mark.timeout(90)
def test_a_killed_launcher_takes_its_job_and_nothing_else(tmp_path: Path) -> None:
    bystander = subprocess.Popen(["sleep", "300"])  # no token: not the job's
    other_job = subprocess.Popen(["sleep", "300"], env={**os.environ, TOKEN_ENV: "other-job"})
    proc, token, pids = _start_fake("hang")
    try:
        assert sorted(job_processes(token)) == sorted(pids)
        guards = _guards(token)
        end = time.monotonic() + DEADLINE_S  # its cmdline is empty while it is still in execve
        while not guards and time.monotonic() < end:
            time.sleep(0.1)
            guards = _guards(token)
        assert len(guards) == 1, guards
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's whole process group
        _, err = proc.communicate(timeout=DEADLINE_S)  # EOF: the guard closed stderr
        assert _wait_gone(pids) == [], err
        assert _wait_gone(guards) == [], "the guard outlived the job"
        assert "stopping its 2 remaining process(es): SIGTERM now, SIGKILL after 2 s" in err, err
        assert "1 process(es) still running after SIGTERM: SIGKILLed" in err, err
        assert _alive(bystander.pid) and _alive(other_job.pid)
    finally:
        _kill(pids)
        for p in (bystander, other_job):
            p.kill()
            p.wait()


@pytest.mark.timeout(60)
def test_processes_that_outlive_the_workers_end_with_the_launch() -> None:
    # A loader worker stuck since its rank exited kept the launch's stdout open: a test that
    # captured it waited 400 s although the launch had ended.
    proc, token, pids = _start_fake("leftover")
    _, err = proc.communicate(timeout=DEADLINE_S)  # EOF: nothing holds the pipe any more
    assert proc.returncode == 0, err
    assert _wait_gone(pids) == []
    assert "the job's processes outlived its workers" in err, err
    assert "stopping its 2 remaining process(es)" in err, err
    assert "1 process(es) still running after SIGTERM: SIGKILLed" in err, err  # ignores TERM
    assert job_processes(token) == []


@pytest.mark.timeout(60)
def test_a_normal_exit_leaves_no_guard_and_a_reused_pid_is_never_signalled() -> None:
    proc, token, _ = _start_fake("normal")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert _wait_gone(_guards(token), 30) == [], "a guard outlived a clean exit"
    assert "meshrun launch" not in err  # the clean path says nothing
    # A stale list (a worker's PID now another process's): the token check skips it.
    stranger = subprocess.Popen(["sleep", "300"])
    # A launch inside a job's worker: its workers carry both jobs' tokens, whole words only.
    nested = subprocess.Popen(["sleep", "300"], env={**os.environ, TOKEN_ENV: "outer-1 inner-2"})
    try:
        assert signal_job(token, [stranger.pid], signal.SIGKILL) == []
        assert _alive(stranger.pid)
        assert nested.pid in job_processes("outer-1") and nested.pid in job_processes("inner-2")
        assert nested.pid not in job_processes("inner")
    finally:
        for p in (stranger, nested):
            p.kill()
            p.wait()


def _launch(tmp_path: Path, flags: list[str], script: str, *keys: str) -> subprocess.Popen[str]:
    argv = [
        sys.executable,
        "-m",
        "meshrun",
        "launch",
        "--nproc-per-node",
        "2",
        *flags,
        str(SCRIPTS / script),
        f"--job.run_dir={tmp_path / 'run'}",
        *keys,
    ]
    return subprocess.Popen(
        argv,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _ready_pids(proc: subprocess.Popen[str], pattern: str) -> tuple[list[int], str]:
    assert proc.stdout is not None
    pids: list[int] = []
    seen = ""
    while len(pids) < 2:
        line = proc.stdout.readline()
        assert line, f"the launcher exited before its workers were ready:\n{seen[-3000:]}"
        seen += line
        pids += [int(pid) for pid in re.findall(pattern, line)]
    return pids, seen


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_restarted_workers_of_a_plain_script_end_with_a_killed_launcher(tmp_path: Path) -> None:
    proc = _launch(tmp_path, ["--max-restarts", "1"], "orphan_plain_sleep.py")
    pids: list[int] = []
    try:
        # Attempt 1: the group the agent restarted after rank 1's exit 3 on attempt 0.
        pids, seen = _ready_pids(proc, r"ready pid=(\d+) attempt=1")
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: the workers are not in it
        out, _ = proc.communicate(timeout=DEADLINE_S)  # EOF once workers and guard are gone
        out = seen + out
        print(out[-3000:])
        assert _wait_gone(pids) == [], out[-3000:]
        assert "restart 1 of 1" in out, out[-3000:]
        assert "stopping its 2 remaining process(es)" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill(pids)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_meshrun_script_saves_and_ends_when_its_launcher_is_killed(tmp_path: Path) -> None:
    proc = _launch(tmp_path, [], "orphan_meshrun_steps.py", "--optim.steps=100000")
    pids: list[int] = []
    try:
        pids, seen = _ready_pids(proc, r"ready pid=(\d+)")
        os.kill(proc.pid, signal.SIGKILL)  # kill -9 of the launcher alone
        out, _ = proc.communicate(timeout=DEADLINE_S)
        out = seen + out
        print(out[-3000:])
        assert _wait_gone(pids) == [], out[-3000:]
        # The guard's SIGTERM is a preemption signal to meshrun: the ranks save, then exit.
        saved = list((tmp_path / "run" / "checkpoints").glob("step_*/.metadata"))
        assert saved, f"no preemption checkpoint in {tmp_path / 'run'}:\n{out[-3000:]}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill(pids)


@pytest.mark.timeout(240)
def test_a_hung_rank_s_stuck_loader_workers_end_with_the_launch(tmp_path: Path) -> None:
    # The watchdog ends each rank (exit 124); their loader workers, which never answer, are
    # not the agent's and stayed, holding the captured output open: this run never returned.
    script = SCRIPTS / "stuck_loader_worker.py"
    args = ["--data.num_workers=1", "--data.micro_batch=2", "--monitor.phase_timeout_s=5"]
    cmd = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", str(script)]
    p = subprocess.run(
        [*cmd, f"--job.run_dir={tmp_path / 'run'}", *args],
        capture_output=True,
        text=True,
        timeout=180,  # a hang guard for a loaded machine (about 25 s here), not a timing
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    out = p.stdout + p.stderr
    assert p.returncode == 124, out[-3000:]
    assert "made no progress for 5 s (phase train, after step 0)" in out, out[-3000:]
    assert "the job's processes outlived its workers" in out, out[-3000:]
