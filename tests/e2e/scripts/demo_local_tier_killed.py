"""The demo, except that rank 1 SIGKILLs itself after optimizer step $KILL_AFTER (once; the
marker file $KILL_MARKER records it, so the restarted worker group trains on). With
$WIPE_LOCAL_DIR set, rank 1 first deletes that directory (its node's local snapshots): a node
replaced by one with empty local storage. Several kills: comma-separated steps, markers and
wipe flags (1/0), one per kill."""

import os
import shutil
import signal
from pathlib import Path
from typing import Any

from meshrun.checkpoint.checkpointer import Checkpointer
from meshrun.demo import train

STEPS = [int(s) for s in os.environ["KILL_AFTER"].split(",")]
MARKERS = [Path(p) for p in os.environ["KILL_MARKER"].split(",")]
WIPES = os.environ.get("WIPE", "0" * len(STEPS)).split(",")
WIPE_DIR = Path(os.environ.get("WIPE_LOCAL_DIR", "/nonexistent"))
_maybe_save = Checkpointer.maybe_save


def maybe_save_or_die(self: Checkpointer, step: int, *args: Any, **kwargs: Any) -> Any:
    out = _maybe_save(self, step, *args, **kwargs)
    for at, marker, wipe in zip(STEPS, MARKERS, WIPES, strict=True):
        if self.facts.rank == 1 and step == at and not marker.exists():
            if wipe == "1":
                shutil.rmtree(WIPE_DIR)
            marker.write_text(f"killed after step {at}, pid {os.getpid()}, wiped {wipe}\n")
            os.kill(os.getpid(), signal.SIGKILL)
    return out


Checkpointer.maybe_save = maybe_save_or_die  # type: ignore[method-assign]
train.main()
