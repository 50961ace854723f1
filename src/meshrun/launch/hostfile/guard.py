"""``python -m meshrun.launch.hostfile.guard -- CMD...``: run CMD until the ssh session that started it ends.

A remote command started by ``ssh`` without a terminal gets no signal when the ssh client
dies: it would keep training, orphaned. ``meshrun launch --hostfile`` therefore starts each
host's ``meshrun launch`` under this guard, which watches its own stdin (the ssh channel):
when it closes (the launcher stopped this host, or the connection dropped), or on
SIGTERM/SIGHUP/SIGINT, the guard sends SIGTERM to CMD (the torchrun agent, which stops its
workers), and after a grace period SIGKILLs CMD and everything below it (torch starts each
worker in its own session, so a process-group kill would miss them). Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType

GRACE_S = 15.0  # SIGTERM -> SIGKILL; the agent needs a few seconds to stop its workers
_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name (field 2) may hold spaces: parse after its closing paren.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _become_subreaper() -> None:
    """Orphans below us (workers of an agent that died) become our children, not init's,
    so the guard can still find and stop them. Linux only; elsewhere a no-op."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_guarded(argv: list[str], grace_s: float = GRACE_S) -> int:
    """Run ``argv``; stop it when stdin closes or a stop signal arrives. Its exit status."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)
    _become_subreaper()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    threading.Thread(target=_wait_for_eof, args=(stop,), daemon=True).start()
    while proc.poll() is None and not stop.wait(0.2):
        pass
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _kill([proc.pid, *descendants(proc.pid)])
    # Whatever is still below us now is an orphan (we are its subreaper): nobody else will
    # stop it, and the session that asked for it has ended or is about to.
    _kill(descendants(os.getpid()))
    code = proc.wait()
    return code if code >= 0 else 128 - code  # killed by signal N: the shell's 128 + N


def _wait_for_eof(stop: threading.Event) -> None:
    try:
        while os.read(sys.stdin.fileno(), 65536):
            pass  # nothing is ever sent: only the end of the channel matters
    except (OSError, ValueError):
        pass
    stop.set()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(
            "usage: python -m meshrun.launch.hostfile.guard -- COMMAND [ARGS...]", file=sys.stderr
        )
        return 2
    return run_guarded(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
