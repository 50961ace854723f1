"""The job's processes end with ``meshrun launch``, even when it is SIGKILLed. Linux only.

torch elastic starts every worker in a session of its own (setsid), so a ``kill -9`` of the
launcher, or of its process group, leaves the workers running with nobody to stop them, where
SLURM and Kubernetes end a job's processes with the job. SIGKILL cannot be caught, so the
answer lives outside the launcher: :func:`orphan_guard` starts this file as a small process
of its own (its own session, so a kill of the launcher's group misses it; the standard
library only, no torch) and marks the job with one variable, ``MESHRUN_JOB_TOKEN``, in the
environment the agent copies into every worker, at every restart, and that their children
(DataLoader workers, a nested launch) inherit. The guard reads a pipe whose write end only
the launcher holds. ``done`` (the launcher returned or raised: the agent has stopped its
workers) ends the guard; the end of the pipe without it (the launcher died) makes it SIGTERM
every process that carries the job's token, and SIGKILL those still running ``GRACE_S``
later (a meshrun script saves its preemption checkpoint in between).

Why a token and not a list of PIDs from the launcher: the token reaches a restarted group's
workers and their children with no hook into the agent and no gap between a fork and a
message, and it cannot match an unrelated process that got a dead worker's PID. Each signal
goes through a pidfd opened before the token is checked again, so a PID reused in between is
never hit. A process that drops the variable from its environment (``env -i``) is not seen.
/proc is scanned again through the grace period and until a SIGKILL scan finds none, so a
process forked after a scan is ended too, and one caught inside execve (its environment
reads empty there for a moment) is read again rather than passed over.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess

TOKEN_ENV = "MESHRUN_JOB_TOKEN"
GRACE_S = 10.0  # SIGTERM -> SIGKILL, as the launcher's own SIGTERM path (watch.py)
DONE = b"done\n"
_POLL_S = 0.1
# An empty environ of a live process is read again this often (execve takes well under 1 ms
# unloaded, a few ms on a loaded machine): at most 0.5 s more per scan.
_EMPTY_RETRIES = 50
_EMPTY_RETRY_S = 0.01
# include/linux/sched.h, the flags field of /proc/<pid>/stat: a kernel thread's environ reads
# empty for good; an exiting process's reads empty (or fails) and needs no signal any more.
_PF_KTHREAD = 0x00200000
_PF_EXITING = 0x00000004
_KILL_ROUNDS = 20  # SIGKILL scans until none is left: a process may fork before its SIGKILL


@contextmanager
def orphan_guard(grace_s: float = GRACE_S) -> Iterator[None]:
    """Around the agent: workers started inside are ended if this process dies (Linux; a no-op
    elsewhere). Sets ``MESHRUN_JOB_TOKEN`` for the workers and puts the old value back after."""
    if not sys.platform.startswith("linux"):
        yield
        return
    import secrets  # here, not at the top: the guard process itself starts without them
    import subprocess

    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    # The guard carries no token, not even an enclosing job's (a launch inside a worker): an
    # outer guard must not end it before it has ended its own job. Its stdin is the pipe
    # (non-inheritable on our side: no worker holds the write end open).
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    guard = subprocess.Popen(
        [sys.executable, "-I", "-S", __file__, token, str(grace_s), str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    previous = os.environ.get(TOKEN_ENV)
    # An enclosing job's tokens stay: its guard ends this job's workers as well.
    os.environ[TOKEN_ENV] = f"{previous} {token}" if previous else token
    try:
        yield
    finally:
        end_leftovers(token, grace_s)
        if previous is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = previous
        _release(guard)


def _release(guard: subprocess.Popen[bytes]) -> None:
    import threading

    assert guard.stdin is not None
    with contextlib.suppress(OSError):  # the guard died (killed by hand): nothing to tell
        guard.stdin.write(DONE)
    with contextlib.suppress(OSError):
        guard.stdin.close()
    # It exits on reading "done", once its interpreter is up (0.1-0.2 s on a loaded 2-core
    # machine): reaped from a thread, so that neither the exit waits nor a zombie stays.
    threading.Thread(target=guard.wait, name="meshrun-orphan-guard", daemon=True).start()


# --- the guard process (standard library only: it runs as a plain file, no meshrun import) ---


def job_processes(token: str) -> list[int]:
    """PIDs of the processes whose ``MESHRUN_JOB_TOKEN`` (space-separated) holds ``token``."""
    pids = [int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()]
    return sorted(pid for pid in _carrying(pids, token) if pid != os.getpid())


def _carrying(pids: list[int], token: str) -> set[int]:
    """Those of ``pids`` that carry ``token``.

    A live process reads empty for a moment inside execve (the new image's environment is
    not set up yet): those are read again, all together, until they read full or are gone. One
    that really has an empty environment (``env -i``) costs the retries once per scan.
    """
    prefix = f"{TOKEN_ENV}=".encode()
    found: set[int] = set()
    for _ in range(_EMPTY_RETRIES):
        unsure = []
        for pid in pids:
            environ = _environ(pid)
            if environ is None:
                unsure.append(pid)
            elif any(
                token.encode() in e[len(prefix) :].split() for e in environ if e.startswith(prefix)
            ):
                found.add(pid)
        if not unsure:
            break
        pids = unsure
        time.sleep(_EMPTY_RETRY_S)
    return found


def _environ(pid: int) -> list[bytes] | None:
    """The entries of ``/proc/<pid>/environ``: none for a process gone, exiting or another
    user's; ``None`` (read again) for a live one that reads empty."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return []  # gone, or another user's
    if data:
        return data.split(b"\0")
    return None if _live_user_process(pid) else []


def _live_user_process(pid: int) -> bool:
    """Not a zombie, not exiting, and not a kernel thread."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in (b"Z", b"X") and not int(fields[6]) & (_PF_KTHREAD | _PF_EXITING)


def signal_job(token: str, pids: list[int], sig: int) -> list[int]:
    """Send ``sig`` to each of ``pids`` that still carries the token; the PIDs signalled."""
    sent = []
    for pid in pids:
        fd = _pidfd(pid)
        try:
            # Checked after the pidfd is open: if the PID was reused before that, the new
            # process lacks the token; after it, the pidfd still names the process checked.
            if pid not in _carrying([pid], token):
                continue
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(pid, sig)
            sent.append(pid)
        except ProcessLookupError:
            pass
        finally:
            if fd is not None:
                os.close(fd)
    return sent


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # an older kernel: os.kill after the check (a window of microseconds)


def end_leftovers(token: str, grace_s: float = GRACE_S) -> int:
    """In the launcher, once the agent has stopped its workers: end the job's processes that
    outlived them, as :func:`end_job`. The agent stops only the workers it started; a loader
    worker that never answers (stuck as it started) stays when its rank exits, and holds the
    launch's stdout and stderr open, so whatever reads them (a pipe, ``| tee``, a test's
    captured output) waited for it for ever although the launch had ended. None is left after
    a clean run: the scan of /proc is all it costs then."""
    why = "the job's processes outlived its workers (a loader worker that never answered?)"
    return end_job(token, grace_s, os.getpid(), why)


def end_job(token: str, grace_s: float, launcher: int, why: str | None = None) -> int:
    """SIGTERM the job's processes, SIGKILL what is left after ``grace_s``; how many there were.
    ``why``: what the message says of them (default: the launcher died without stopping them)."""
    termed = set(signal_job(token, job_processes(token), signal.SIGTERM))
    if not termed:
        return 0
    why = why or f"the launcher (pid {launcher}) ended without stopping its workers (killed?)"
    _say(
        f"meshrun launch: {why}; stopping its {len(termed)} remaining process(es): SIGTERM now, "
        f"SIGKILL after {grace_s:g} s"
    )
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (running := job_processes(token)):
        # Again from /proc: a process forked after the first scan (a DataLoader worker, a
        # checkpoint writer) carries the token as well, and gets its SIGTERM now.
        termed.update(signal_job(token, [p for p in running if p not in termed], signal.SIGTERM))
        time.sleep(_POLL_S)
    killed: set[int] = set()
    for _ in range(_KILL_ROUNDS):  # until a scan finds none: one may fork before its SIGKILL
        left = signal_job(token, job_processes(token), signal.SIGKILL)
        if not left:
            break
        killed.update(left)
        time.sleep(_POLL_S)
    if killed:
        _say(f"meshrun launch: {len(killed)} process(es) still running after SIGTERM: SIGKILLed")
    return len(termed)


def _say(text: str) -> None:
    with contextlib.suppress(OSError):  # the launcher's stderr may be a closed pipe by now
        print(text, file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    token, grace_s, launcher = argv[0], float(argv[1]), int(argv[2])
    # In its own session, no terminal signal reaches the guard; SIGINT is ignored all the same,
    # so that nothing but the end of the pipe decides what it does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    received = b""
    while chunk := os.read(sys.stdin.fileno(), 4096):
        received += chunk
    if DONE not in received:
        end_job(token, grace_s, launcher)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
