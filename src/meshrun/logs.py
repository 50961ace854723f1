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
import sys
import warnings
from pathlib import Path
from typing import TextIO

LOGGER_NAME = "meshrun"
OWN_RANK = {"per_rank": True}  # extra= of a warning that differs from rank to rank
OWN_HOST = {"per_host": True}  # extra= of a warning about this host

_SHOW_WARNING = warnings.showwarning  # Python's, given back to rank 0


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class _ConsoleFilter(logging.Filter):
    """What a rank other than 0 prints: its errors, and only its own warnings."""

    def __init__(self, rank: int, local_rank: int) -> None:
        super().__init__()
        self.rank, self.local_rank = rank, local_rank

    def filter(self, record: logging.LogRecord) -> bool:
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
    log.filters = [_RankFilter(rank)]

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
