"""The demo, except that rank 0 SIGKILLs itself in the middle of the save of step
$KILL_IN_SAVE_AT (shards written, manifest not yet committed), once: $KILL_MARKER records that it
happened, so the restarted worker group trains on."""

import os
import signal
from pathlib import Path
from typing import Any

from meshrun.checkpoint import on_disk
from meshrun.demo import train

KILL_AT = int(os.environ["KILL_IN_SAVE_AT"])
MARKER = Path(os.environ["KILL_MARKER"])
_commit = on_disk.commit_dir


def commit_or_die(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    if manifest["step"] == KILL_AT and not MARKER.exists():
        MARKER.write_text(f"killed in the save of step {KILL_AT}, pid {os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    _commit(tmp, final, manifest)


on_disk.commit_dir = commit_or_die
train.main()
