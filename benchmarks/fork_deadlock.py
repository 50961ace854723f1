"""Does a child forked from a multi-threaded Python process get stuck inside ``os.fork()``?

No torch, no meshrun: three threads start native threads one after another, each of which
enters Python once (a ctypes callback: ``PyGILState_Ensure`` gives it a new Python thread
state, as a C++ thread calling into Python gets one), while the main thread forks children
that exit at once. A child still running after 5 s is stuck; the first one's stack is printed
(gdb, if installed). On CPython 3.8-3.11 before the fix of gh-112275 the child waits for ever
for the runtime's thread-state lock that a native thread held at the fork
(``PyOS_AfterFork_Child`` -> ``_PyEval_ReInitThreads`` -> ``_PyThreadState_DeleteExcept``):
the deadlock behind docs/data.md's "How workers start".

    python benchmarks/fork_deadlock.py 6000     # Linux; about 1-2 minutes on 2 cores

Measured on the 2-core test machine beside two busy-loop processes: Python 3.11.7, 7 and 13
children stuck of 6,000 (two runs); Python 3.12.1, 0 of 6,000.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import threading
import time

STUCK_AFTER_S = 5.0
_libc = ctypes.CDLL(None)
_ENTRY = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


@_ENTRY
def _enter_python(_: int) -> None:
    return None


def _native_threads() -> None:
    tid = ctypes.c_ulong()
    while True:
        _libc.pthread_create(ctypes.byref(tid), None, _enter_python, None)
        _libc.pthread_join(tid, None)


def _exited_within(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if os.waitpid(pid, os.WNOHANG)[0] != 0:
            return True
        time.sleep(0.001)
    return False


def main(forks: int) -> int:
    for _ in range(3):
        threading.Thread(target=_native_threads, daemon=True).start()
    stuck, t0 = [], time.monotonic()
    for _ in range(forks):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        if not _exited_within(pid, STUCK_AFTER_S):
            stuck.append(pid)
    print(
        f"python {sys.version.split()[0]}: {forks} forks, {len(stuck)} children stuck "
        f"({time.monotonic() - t0:.0f} s)"
    )
    if stuck and shutil.which("gdb"):
        bt = ["gdb", "-p", str(stuck[0]), "-batch", "-ex", "bt 12"]
        frames = subprocess.run(bt, capture_output=True, text=True, check=False).stdout
        print("\n".join(line for line in frames.splitlines() if line.startswith("#")))
    for pid in stuck:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return 1 if stuck else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 6000))
