"""Rank-aware logging: rank 0 talks to the console, every rank writes its own file.

A warning that every rank reaches (most are: they come from the config, the model or the data,
the same everywhere) is printed once, by rank 0; another rank's console shows its errors, and
its warnings only when they are its own: logged with ``extra=OWN_RANK`` (this rank's shard,
its checkpoint files) or ``extra=OWN_HOST`` (this machine's memory, network, GPUs: shown by
each host's local rank 0). Every rank's file (``RUN_DIR/logs/rankN.log``) keeps all of its
records, and Python's ``warnings`` of ranks other than 0 (torch's, the user's) go there too.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TextIO

from meshrun.config.fields import ConfigError

LOGGER_NAME = "meshrun"
OWN_RANK = {"per_rank": True}  # extra= of a warning that differs from rank to rank
OWN_HOST = {"per_host": True}  # extra= of a warning about this host
FILE_ONLY = {"file_only": True}  # extra= of a record for the rank's file, never the console

_SHOW_WARNING = warnings.showwarning  # Python's, given back to rank 0


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class _ConsoleFilter(logging.Filter):
    """What a rank other than 0 prints: its errors, and only its own warnings (and no rank
    prints a FILE_ONLY record)."""

    def __init__(self, rank: int, local_rank: int) -> None:
        super().__init__()
        self.rank, self.local_rank = rank, local_rank

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "file_only", False):
            return False
        if self.rank == 0 or record.levelno >= logging.ERROR:
            return True
        if getattr(record, "per_rank", False):
            return True
        return self.local_rank == 0 and bool(getattr(record, "per_host", False))


def init_logging(
    rank: int, run_dir: Path | None, level: str = "info", local_rank: int | None = None
) -> logging.Logger:
    """Configure the ``meshrun`` logger for this rank (idempotent: replaces our handlers).
    ``local_rank``: this rank's index on its host (default ``rank``), for OWN_HOST warnings."""
    log = logging.getLogger(LOGGER_NAME)
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    log.setLevel(logging.DEBUG)
    log.propagate = False
    log.filters = []  # the rank goes on the file handler: a child logger's records reach it too

    console = logging.StreamHandler(sys.stderr)
    # Rank 0 shows everything at the chosen level; other ranks only what needs attention.
    console.setLevel(getattr(logging, level.upper()) if rank == 0 else logging.WARNING)
    console.setFormatter(_ConsoleFormatter(rank))
    console.addFilter(_ConsoleFilter(rank, rank if local_rank is None else local_rank))
    log.addHandler(console)

    if run_dir is not None:
        path = Path(run_dir) / "logs" / f"rank{rank}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(path, mode="a")
        fh.setLevel(logging.DEBUG)
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [rank %(rank)s] %(message)s"))
        fh.addFilter(_RankFilter(rank))
        log.addHandler(fh)
    _route_python_warnings(log, rank)
    return log


def _route_python_warnings(log: logging.Logger, rank: int) -> None:
    """Rank 0 prints Python's warnings as Python does; another rank logs them to its file
    (they are the same torch or library warnings rank 0 just printed)."""
    if rank == 0:
        warnings.showwarning = _SHOW_WARNING
        return

    def to_file(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
        log.warning("%s", text)  # no OWN_RANK: the console filter keeps it off the console

    warnings.showwarning = to_file


# --- an uncaught exception that is another rank's doing -------------------------------------

# What Gloo says when the other end of a connection went away: its process was killed or
# failed. A surviving rank then fails in its next collective, a consequence, not a cause.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
_GLOO_SOURCE = re.compile(r"^\[[^\]]*gloo[^\]]*\]\s*")  # "[.../gloo/transport/tcp/pair.cc:537] "
ShowException = Callable[[type[BaseException], BaseException, TracebackType | None], object]


def peer_lost(exc: BaseException) -> str | None:
    """The short text of a Gloo error raised because a peer's connection went away (``Read
    error [10.0.0.2]:4321: Connection reset by peer``); None for any other exception."""
    text = str(exc)
    if "gloo" not in text.lower() or not any(p in text for p in _PEER_GONE):
        return None
    return _GLOO_SOURCE.sub("", text.splitlines()[0]).split(". ", 1)[0]


def report_uncaught(
    tp: type[BaseException], exc: BaseException, tb: TracebackType | None, show: ShowException
) -> None:
    """Report the exception that ends this rank. A refusal (``ConfigError``) is one line on
    stderr, ``meshrun rank N: error: ...``, its traceback in the rank's log file (if any); the
    launcher's summary shows the message whole. A lost Gloo peer is one line on stderr
    naming this rank's log file, which keeps the traceback: when one rank is killed, every
    other one fails in its next collective, and their tracebacks would bury the line that
    names the first failure. Anything else (or no log file): ``show`` (Python's hook)."""
    log = logging.getLogger(LOGGER_NAME)
    if isinstance(exc, ConfigError):
        # A refusal (bad input, met alike by every rank): its message names the key, the value
        # and the fix; a traceback per rank would bury it. The traceback goes to the log file.
        log.error("refused", exc_info=(tp, exc, tb), extra=FILE_ONLY)
        say_rank_error(one_line(exc))
        return
    short = peer_lost(exc)
    files = [h.baseFilename for h in log.handlers if isinstance(h, logging.FileHandler)]
    if short is None or not files:
        show(tp, exc, tb)
        return
    log.error("a peer rank went away during a collective", exc_info=(tp, exc, tb), extra=FILE_ONLY)
    say_line(
        f"{tp.__name__}: {short}: a peer rank ended during a collective (the launcher names the "
        f"first rank to fail); this rank's traceback is in {files[0]}"
    )


class _ConsoleFormatter(logging.Formatter):
    """Plain messages for info; a level tag for what needs attention; the rank unless 0."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.who = "meshrun" if rank == 0 else f"meshrun [rank {rank}]"

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            return f"{self.who} {record.levelname.lower()}: {msg}"
        return f"{self.who}: {msg}"


def say_line(text: str, stream: TextIO | None = None) -> None:
    """``text`` and its newline in one ``write`` (stderr unless ``stream``), then a flush.

    A node's ranks and its agent share one stdout pipe and one stderr pipe. Under
    ``PYTHONUNBUFFERED=1`` (common in containers and batch scripts) ``print`` writes the text
    and its newline separately, so another process's line can land between them and two lines
    fuse into one; a single write of a line shorter than the pipe's buffer is atomic."""
    out = stream or sys.stderr
    out.write(text + "\n")
    out.flush()


def say_error(command: str, message: object, stream: TextIO | None = None) -> None:
    """The one line every meshrun command stops with: ``meshrun COMMAND: error: MESSAGE``, on
    stderr unless the command reports on ``stream`` (``ckpt`` writes its verdicts to stdout)."""
    say_line(f"meshrun {command}: error: {message}", stream)


def say_rank_error(message: object) -> None:
    """A worker's one error line, ``meshrun rank N: error: MESSAGE`` (N from ``RANK``)."""
    say_error(f"rank {os.environ.get('RANK', '0')}", message)


def say_launch(text: str) -> None:
    """One line of ``meshrun launch`` on stderr (the handshake, the agent's rendezvous,
    replica groups): ``meshrun launch: TEXT``."""
    say_line(f"meshrun launch: {text}")


def one_line(err: BaseException) -> str:
    """An exception as one line: ``Type: message`` with its whitespace folded (``Type`` alone
    when it has no message), for the one-line errors above."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
