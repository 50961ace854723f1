"""Command output: into a pipe whose reader has gone (``meshrun ckpt inspect DIR | head``), and
text from elsewhere (the network, a file) made safe to print on a terminal."""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from collections.abc import Callable

__all__ = ["quiet_on_broken_pipe", "safe_text"]

Command = Callable[[argparse.Namespace], int]

# C0 and C1 control characters and DEL, but not tab or newline: an ESC sequence from a stranger
# can move the cursor, rewrite lines already printed, retitle the window or set the clipboard.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def quiet_on_broken_pipe(fn: Command) -> Command:
    """``fn`` that exits 1 without a traceback when stdout's reader closes early, as the
    Python docs advise (signal module, "Note on SIGPIPE"): stdout is pointed at /dev/null so
    that the interpreter's own flush at exit does not fail a second time."""

    @functools.wraps(fn)
    def wrapper(a: argparse.Namespace) -> int:
        try:
            code = fn(a)
            sys.stdout.flush()  # the last buffered lines meet the closed pipe here, not at exit
            return code
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 1  # what Python itself exits with on EPIPE

    return wrapper


def safe_text(text: str, limit: int = 2000, one_line: bool = False) -> str:
    """``text`` from outside this process as it may be printed: control characters (terminal
    escapes) replaced by ``?``; newlines kept, or with ``one_line`` made spaces (a stranger's
    text cannot then print a line of its own); at most ``limit`` characters."""
    clean = _CONTROL.sub("?", text)
    if one_line:
        clean = " ".join(clean.split())
    return clean if len(clean) <= limit else clean[:limit] + f"... ({len(clean) - limit} more)"
