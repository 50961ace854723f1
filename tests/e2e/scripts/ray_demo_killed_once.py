"""The demo, except that rank 1 SIGKILLs itself right after optimizer step --kill-at-step K,
once: the file --kill-marker PATH records that it happened, so the worker group Ray retries
trains on. With --raise-at-step N, the retried rank 1 then raises a ValueError after step N
(in ``check_batch``, the frame a failure summary must show). The flags are taken out of
sys.argv before the demo reads its own."""

import os
import signal
import sys
from pathlib import Path
from typing import Any

import meshrun
from meshrun.demo import train


def _take(flag: str, default: str | None = None) -> str:
    if flag not in sys.argv and default is not None:
        return default
    i = sys.argv.index(flag)
    value = sys.argv[i + 1]
    del sys.argv[i : i + 2]
    return value


KILL_AT = int(_take("--kill-at-step"))
MARKER = Path(_take("--kill-marker"))
RAISE_AT = int(_take("--raise-at-step", "0"))
_step = meshrun.Run.optimizer_step


def check_batch(run: meshrun.Run) -> None:
    if run.rank == 1 and run.step == RAISE_AT and MARKER.exists():
        raise ValueError(f"bad batch on rank 1 at step {RAISE_AT}")


def step_or_die(self: meshrun.Run, *args: Any, **kwargs: Any) -> bool:
    done = _step(self, *args, **kwargs)
    if done and self.step == KILL_AT and self.rank == 1 and not MARKER.exists():
        MARKER.write_text(f"rank 1 (pid {os.getpid()}) killed itself after step {KILL_AT}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    if done:
        check_batch(self)
    return done


meshrun.Run.optimizer_step = step_or_die  # type: ignore[method-assign]
train.main()
