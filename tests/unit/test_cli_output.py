"""What commands print: `meshrun bench compute`'s figures as aligned lines with their units, and
`meshrun ckpt ... | head` (a reader that goes away) ending quietly, without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.diagnose.calibration import compute_lines


def test_compute_figures_are_aligned_lines_with_their_units() -> None:
    lines = compute_lines(
        {"matmul_flops": 28.35e9, "model_flops": 9.1e9, "mem_bw": 12.5e9, "optimizer_bw": 2.25e9}
    )
    assert lines == [
        "compute, slowest rank:",
        "  matmul (peak)                28.35 GFLOP/s",
        "  demo GPT training             9.10 GFLOP/s",
        "  memory copy (64 MiB)         12.50 GB/s",  # bytes per second, not FLOP/s
        "  AdamW step (28 B/param)       2.25 GB/s",
    ]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "command",
    [["ckpt", "list"], ["ckpt", "inspect"], ["ckpt", "verify"], ["config", "show"], ["plan"]],
)
def test_output_into_a_closed_pipe_exits_1_without_a_traceback(
    tmp_path: Path, command: list[str]
) -> None:
    # The reader end is closed before the command starts: its first write meets EPIPE, as
    # `meshrun ckpt inspect DIR | head` does once head has read its lines (deterministic).
    read, write = os.pipe()
    os.close(read)
    try:
        p = subprocess.run(
            [sys.executable, "-m", "meshrun", *command, *_target(command, tmp_path)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=50,
            check=False,
        )
    finally:
        os.close(write)
    assert p.stderr == "", p.stderr
    assert p.returncode == 1


def _target(command: list[str], tmp_path: Path) -> list[str]:
    if command[0] == "ckpt":
        return [str(tmp_path)]
    if command[0] == "plan":  # a small model on a small cluster: enough lines to fill no pipe
        return ["--params", "1e9", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "h100-sxm"]
    return []
