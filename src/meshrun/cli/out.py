"""Command output into a pipe whose reader has gone (``meshrun ckpt inspect DIR | head``). Text
from elsewhere (the network, a file) is made safe to print by runtime/secret.py's ``sanitize``."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable

__all__ = ["quiet_on_broken_pipe"]

Command = Callable[[argparse.Namespace], int]


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
