"""``ray start`` for the Ray tests, inside a network namespace the test made.

Ray's node start waits a hard-coded 30 s for its raylet to register with the GCS
(ray/_private/node.py, 2.60); on a loaded 2-core machine that wait can run out before anything
is wrong ("The current node timed out during startup"). That one failure is retried, after the
namespace's leftovers are killed; any other failure fails the test at once."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

TRIES = 3
SLOW_START = "The current node timed out during startup"


def start_ray(argv: list[str], env: dict[str, str], log: Path, clean: Callable[[], None]) -> str:
    """Run ``argv`` (a ``ray start`` wrapped in ``ip netns exec``); its output."""
    text = ""
    for _ in range(TRIES):
        with open(log, "w") as out:
            proc = subprocess.run(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600, check=False
            )
        text = log.read_text()
        if proc.returncode == 0:
            return text
        if SLOW_START not in text:
            break
        clean()  # what the timed-out start left running in the namespace
    raise AssertionError(f"ray start failed:\n{text[-4000:]}")
