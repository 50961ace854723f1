"""Rank-aware logging: rank 0 talks to the console, every rank writes its own file, and a
warning or error on any rank reaches the console tagged with that rank."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOGGER_NAME = "meshrun"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def init_logging(rank: int, run_dir: Path | None, level: str = "info") -> logging.Logger:
    """Configure the ``meshrun`` logger for this rank (idempotent: replaces our handlers)."""
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
    log.addHandler(console)

    if run_dir is not None:
        path = Path(run_dir) / "logs" / f"rank{rank}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(path, mode="a")
        fh.setLevel(logging.DEBUG)
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [rank %(rank)s] %(message)s"))
        log.addHandler(fh)
    return log


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
