"""The failure summary of a ``meshrun ray launch`` job: the rank that failed first, its host,
cause and traceback, as ``meshrun launch`` prints for torchrun (launch/agent/failures.py).

Ray reports which workers failed (``WorkerGroupError.worker_failures``: world rank ->
exception); each worker left ``RUN_DIR/logs/ray/rank<r>/`` files (launch/ray/worker.py): where it ran,
its exit code, and torch elastic's error file when the script's exception was recorded. Pure
apart from reading those files: unit-tested without Ray.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrun.launch.agent.failures import RULE, TRACEBACK_LINES, describe_exit

__all__ = ["RankFailure", "read_failures", "summarize"]

DIED = (
    "the worker process died without an exit status (a signal such as SIGKILL, the "
    "out-of-memory killer, or its node lost)"
)


@dataclass(frozen=True)
class RankFailure:
    rank: int
    ray_error: str  # Ray's text of the worker's exception
    where: Mapping[str, Any] = field(default_factory=dict)  # where.json
    exit: Mapping[str, Any] = field(default_factory=dict)  # exit.json: {"code", "time"}
    error_file: Mapping[str, Any] = field(default_factory=dict)  # torch elastic's error.json

    @property
    def host(self) -> str:
        return str(self.where.get("host", "unknown host"))

    @property
    def exit_code(self) -> int | None:
        code = self.exit.get("code")
        return int(code) if code is not None else None

    @property
    def died(self) -> bool:
        return self.exit_code is None

    def order_key(self) -> tuple[float, int]:
        # A process that died left no exit record: it went first, its peers' errors (a Gloo
        # "connection closed by peer") came after; the others by the time they exited.
        return (-math.inf if self.died else float(self.exit.get("time", math.inf)), self.rank)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_failures(logs_dir: str | Path, failures: Mapping[int, BaseException]) -> list[RankFailure]:
    """The failed ranks with what their files say, the likely root cause first."""
    out = []
    for rank, exc in failures.items():
        files = Path(logs_dir) / f"rank{rank}"
        out.append(
            RankFailure(
                rank=rank,
                ray_error=str(exc).strip() or type(exc).__name__,
                where=_read(files / "where.json"),
                exit=_read(files / "exit.json"),
                error_file=_read(files / "error.json"),
            )
        )
    return sorted(out, key=RankFailure.order_key)


def _message(f: RankFailure) -> str:
    message = f.error_file.get("message")
    if isinstance(message, dict):
        return str(message.get("message", ""))
    lines = [line for line in f.ray_error.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _callstack(f: RankFailure) -> str:
    message = f.error_file.get("message")
    if not isinstance(message, dict):
        return ""
    return str(message.get("extraInfo", {}).get("py_callstack", ""))


def _cause(f: RankFailure) -> str:
    return DIED if f.exit_code is None else describe_exit(f.exit_code)


def _describe_first(f: RankFailure) -> list[str]:
    where = f"local rank {f.where.get('local_rank', '?')}, node rank "
    where += f"{f.where.get('node_rank', '?')}, pid {f.where.get('pid', '?')}"
    lines = [f"  cause : {_cause(f)}", f"  where : {where}"]
    if message := _message(f):
        lines.append(f"  error : {message[:200]}")
    if callstack := _callstack(f):
        lines.append("  traceback (from the error file written by @record):")
        lines += ["    " + x for x in callstack.splitlines()[-TRACEBACK_LINES:]]
    else:
        lines.append("  Ray's error for this worker:")
        lines += ["    " + x for x in f.ray_error.splitlines()[-TRACEBACK_LINES:]]
    return lines


def summarize(failures: list[RankFailure]) -> tuple[str, int]:
    """The summary text and the launcher's exit code (the first rank's own, else 1)."""
    if not failures:
        raise ValueError("summarize needs at least one failed rank")
    first = failures[0]
    lines = [RULE, f"meshrun ray launch: rank {first.rank} failed first (host {first.host})"]
    lines += _describe_first(first)
    if failures[1:]:
        lines.append("  also failed (likely victims):")
        for f in failures[1:9]:
            cause = "died" if f.died else f"exit code {f.exit_code}"
            lines.append(f"    rank {f.rank} on {f.host} ({cause}): {_message(f)[:70]}")
    lines.append(RULE)
    code = first.exit_code
    return "\n".join(lines), code if code and code > 0 else 1
