"""One run directory's records as ``meshrun report`` reads them: the process starts (a
restart appends to the same ``metrics.jsonl``) with their step lines and events."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunData", "Session"]


@dataclass
class Session:
    """The records of one process start (the first run, or a restart appending to the file)."""

    start: dict[str, Any] | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]


@dataclass
class RunData:
    """One run directory's records."""

    path: Path
    name: str
    sessions: list[Session]
    config: dict[str, Any]
    skipped_lines: int = 0  # unreadable lines (a crash in the middle of a write)

    @property
    def rows(self) -> list[dict[str, Any]]:
        return [r for s in self.sessions for r in s.rows]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for s in self.sessions for e in s.of(kind)]
