"""meshrun's own lines reach a pipe whole: a node's ranks and its agent share one stdout and
one stderr pipe, and under ``PYTHONUNBUFFERED=1`` ``print`` writes a line's text and its
newline separately, so two ranks' lines could fuse into one."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from meshrun.runtime.logs import say_error, say_line

WRITER = """
import sys
from meshrun.runtime.logs import say_error
rank = sys.argv[1]
for i in range(int(sys.argv[2])):
    say_error(f"rank {rank}", f"line {i} " + "x" * 100)
"""


class _Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_a_line_and_its_newline_are_one_write() -> None:
    out = _Writes()
    say_error("rank 3", "refused", out)
    say_line("meshrun launch: 2 processes", out)
    assert out.calls == ["meshrun rank 3: error: refused\n", "meshrun launch: 2 processes\n"]


def test_two_unbuffered_ranks_on_one_pipe_never_fuse_their_lines() -> None:
    n = 3000
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    read, write = os.pipe()
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(rank), str(n)], stderr=write, env=env)
        for rank in (0, 1)
    ]
    os.close(write)
    with os.fdopen(read) as pipe:
        lines = pipe.read().splitlines()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    for rank in (0, 1):
        mine = [x for x in lines if x.startswith(f"meshrun rank {rank}: error: line ")]
        assert mine == [f"meshrun rank {rank}: error: line {i} " + "x" * 100 for i in range(n)]
    assert len(lines) == 2 * n
