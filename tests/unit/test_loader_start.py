"""Which start method a script's loader workers get: a fork server when the script's training
runs under ``if __name__ == "__main__":`` (the server imports the script again, and only the
guard keeps that import from training), forked workers and a warning when it runs at top level."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BUILD = """
import warnings
from torch.utils.data import SequentialSampler
from meshrun.data import build_dataloader

def start() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loader = build_dataloader(list(range(4)), SequentialSampler(range(4)), 1, num_workers=1)
    print(loader.multiprocessing_context.get_start_method())
    for w in seen:
        if "worker_start" in str(w.message):
            print(w.message)
"""


def start_method(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text(BUILD + body)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.splitlines()


def test_a_guarded_script_gets_a_fork_server(tmp_path: Path) -> None:
    lines = start_method(tmp_path, 'if __name__ == "__main__":\n    start()\n')
    assert lines == ["forkserver"]


def test_a_top_level_script_keeps_forked_workers_and_is_told_why(tmp_path: Path) -> None:
    lines = start_method(tmp_path, "start()\n")
    assert lines[0] == "fork"
    call_line = len(BUILD.splitlines()) + 1  # the last line of the script: start()
    assert f"because {tmp_path / 'train.py'}:{call_line} runs outside" in lines[1], lines
    assert "--data.worker_start=fork" in lines[1]
