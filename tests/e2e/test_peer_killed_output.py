"""When one rank is SIGKILLed, every other rank fails in its next collective with Gloo's
"Connection reset/closed by peer": a consequence, whose traceback would bury the launcher's
line naming the rank that was killed. Such a rank prints one line, starting with the exception
as the launcher's summary reads it and naming its log file, which keeps the traceback.

The two ranks are started here without torchrun's agent, whose SIGTERM to the survivor could
come before its error; ``meshrun launch``'s summary is tests/e2e/test_launch_local.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.runtime.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).parent / "scripts" / "peer_killed.py"


@pytest.mark.parametrize("entry", ["excepthook", "main"])
def test_the_survivor_of_a_killed_peer_prints_one_line(tmp_path: Path, entry: str) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MESHRUN_", "PET_"))}
    base |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "RUN_DIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, str(SCRIPT), entry]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    env = [{**base, "RANK": str(r), "LOCAL_RANK": str(r)} for r in (0, 1)]
    procs = [subprocess.Popen(argv, env=e, **pipes) for e in env]  # type: ignore[call-overload]
    outputs = [p.communicate(timeout=150) for p in procs]
    assert procs[1].returncode == -9
    assert procs[0].returncode == 1, outputs[0][1]
    err = outputs[0][1]
    log = tmp_path / "logs" / "rank0.log"
    assert "Traceback" not in err, err
    (line,) = [s for s in err.splitlines() if "a peer rank ended during a collective" in s]
    assert line.startswith("RuntimeError: ") and "by peer" in line and str(log) in line
    kept = log.read_text()
    assert "Traceback (most recent call last)" in kept and "all_reduce" in kept
