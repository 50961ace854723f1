"""A warning every rank reaches is printed once, by rank 0: another rank's console shows its
errors and its own warnings (``OWN_RANK``; ``OWN_HOST`` on each host's local rank 0), while its
file keeps everything, Python's ``warnings`` too. Each rank is a process of its own here, as
under ``meshrun launch``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = """
import logging, sys, warnings
from pathlib import Path
from meshrun.runtime.logs import OWN_HOST, OWN_RANK, init_logging
rank, local_rank, run_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
log = init_logging(rank, run_dir, "info", local_rank)
log.info("info line")
log.warning("same on every rank")
log.warning("rank %d's own", rank, extra=OWN_RANK)
log.warning("about this host", extra=OWN_HOST)
log.error("an error")
warnings.warn("a library warning", UserWarning)
logging.getLogger("meshrun.script").info("a child logger's line")  # the script's own
"""


def _rank(tmp_path: Path, rank: int, local_rank: int) -> tuple[list[str], str]:
    argv = [sys.executable, "-c", PROGRAM, str(rank), str(local_rank), str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines(), (tmp_path / "logs" / f"rank{rank}.log").read_text()


@pytest.mark.timeout(90)
def test_rank_0_prints_every_warning_once(tmp_path: Path) -> None:
    console, file = _rank(tmp_path, 0, 0)
    assert console[:5] == [
        "meshrun: info line",
        "meshrun warning: same on every rank",
        "meshrun warning: rank 0's own",
        "meshrun warning: about this host",
        "meshrun error: an error",
    ]
    assert any("UserWarning: a library warning" in line for line in console)
    # A logger under meshrun's (``meshrun.script``) is printed and filed as meshrun's own;
    # its records once reached the file handler without the rank its format names.
    assert "meshrun: a child logger's line" in console
    assert not any("Logging error" in line for line in console), console
    assert "[rank 0] a child logger's line" in file


@pytest.mark.timeout(90)
@pytest.mark.parametrize("local_rank", [1, 0])  # the first rank of a second host shows OWN_HOST
def test_another_rank_prints_only_its_own(tmp_path: Path, local_rank: int) -> None:
    console, file = _rank(tmp_path, 3, local_rank)
    expected = ["meshrun [rank 3] warning: rank 3's own"]
    if local_rank == 0:
        expected.append("meshrun [rank 3] warning: about this host")
    assert console == [*expected, "meshrun [rank 3] error: an error"], json.dumps(console)
    for text in ("info line", "same on every rank", "about this host", "a library warning"):
        assert text in file  # the rank's own record keeps all of it
    assert "[rank 3] a child logger's line" in file
