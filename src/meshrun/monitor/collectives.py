"""Where each rank is in the sequence of collectives, from PyTorch's flight recorder.

Every process group numbers its collectives (``collective_seq_id``: 1, 2, 3, ... on every
member rank, since all members call the same collectives in the same order). PyTorch's flight
recorder keeps the last ones per rank; in torch 2.13 it records Gloo collectives as well as
NCCL ones, by default (``TORCH_FR_BUFFER_SIZE``, 2000 entries). The hang watchdog reads, per
process group, the last collective this rank *enqueued* (Gloo marks collectives completed as
they are enqueued, so only the enqueued position is trusted); the launcher's report compares
ranks: "collective #42 (gloo:all_reduce) on group 0 (default_pg): rank 0 at #42, rank 1 at
#41", i.e. rank 1 never called the collective the others wait in.

Point-to-point operations (pipeline sends/receives) are numbered per peer pair, not per group,
and the recorder does not record them on Gloo: monitor/p2p.py counts them for the report.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Position", "collective_lines", "last_collectives", "positions_from_json"]

# The NCCL recorder (CUDA builds) first, then the generic one (Gloo and others).
_DUMPS = ("_dump_nccl_trace_json", "_dump_fr_trace_json")
_MAX_LINES = 4  # a report names the groups that disagree, not every group of a large mesh


@dataclass(frozen=True)
class Position:
    """The last collective one rank enqueued on one process group."""

    seq: int
    op: str  # e.g. "gloo:all_reduce", or "?" when the entry has left the buffer
    group: str  # the group's description, e.g. "default_pg"

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "group": self.group}


def positions_from_json(text: str) -> dict[str, Position]:
    """Per process-group id, this rank's position, from one flight-recorder JSON dump."""
    dump = json.loads(text)
    out: dict[str, Position] = {}
    for pg, status in (dump.get("pg_status") or {}).items():
        seq = int(status.get("last_enqueued_collective", -1))
        if seq > 0:
            out[str(pg)] = Position(seq, "?", "")
    # The newest recorded collective of a group is its position. pg_status alone is not: on
    # Gloo its counter also counts point-to-point operations, which the recorder does not
    # record (torch 2.13, measured: 3 collectives + 3 sends read 6), so under a pipeline it
    # names no recorded collective and differs between stages. It stays the position of a
    # group whose entries have all left the buffer.
    newest: dict[str, Position] = {}
    for e in dump.get("entries") or []:
        pg, seq = str(e.get("pg_id")), int(e.get("collective_seq_id", -1))
        if pg not in out or e.get("is_p2p") or seq <= 0:
            continue
        if pg not in newest or seq > newest[pg].seq:
            group = e.get("process_group") or ["", ""]
            newest[pg] = Position(seq, str(e.get("profiling_name", "?")), group[-1])
    return out | newest


def _read_recorders() -> dict[str, Position]:
    import torch._C._distributed_c10d as c10d  # only in a worker: the launcher needs no torch

    found: dict[str, Position] = {}
    for name in _DUMPS:
        dump = getattr(c10d, name, None)
        if dump is not None:
            for pg, pos in positions_from_json(dump(True, False)).items():
                found.setdefault(pg, pos)
    return found


def last_collectives(timeout_s: float = 5.0) -> dict[str, Any]:
    """This rank's positions for the hang file: ``{"groups": {pg: {...}}}``, or
    ``{"error": why}`` when the recorder is missing, fails, or does not answer in time (it is
    read from the watchdog thread while the main thread is stuck: never wait on it long)."""
    result: dict[str, Any] = {"error": f"the flight recorder did not answer in {timeout_s:g} s"}

    def read() -> None:
        try:
            groups = _read_recorders()
        except Exception as e:  # any failure of a private torch API: report it, go on
            result["error"] = f"flight recorder unavailable: {type(e).__name__}: {e}"
            return
        result.clear()
        result["groups"] = {pg: pos.to_json() for pg, pos in groups.items()}

    reader = threading.Thread(target=read, name="meshrun-flight-recorder", daemon=True)
    reader.start()
    reader.join(timeout_s)
    return dict(result)


def parse_positions(header: Mapping[str, Any]) -> dict[str, Position] | None:
    """The positions in one hang file's header (None: not recorded)."""
    groups = (header.get("collectives") or {}).get("groups")
    if groups is None:
        return None
    return {pg: Position(int(p["seq"]), str(p["op"]), str(p["group"])) for pg, p in groups.items()}


def collective_lines(
    positions: Mapping[int, Mapping[str, Position]], silent: Sequence[int]
) -> list[str]:
    """Report lines: for each process group where the reporting ranks disagree (or, when some
    ranks did not report, the default group), the newest collective and where each rank is.
    ``positions``: rank -> its groups' positions; ``silent``: ranks that did not report."""
    groups = sorted({pg for p in positions.values() for pg in p}, key=_group_order)
    lines: list[str] = []
    for pg in groups:
        at = {rank: p[pg] for rank, p in positions.items() if pg in p}
        top = max(at.values(), key=lambda p: p.seq)
        behind = {r: p.seq for r, p in at.items() if p.seq < top.seq}
        if not behind and not (silent and pg == groups[0]):
            continue
        reached = sorted(r for r, p in at.items() if p.seq == top.seq)
        text = (
            f"  collective #{top.seq} ({top.op}) on process group {pg} ({top.group or '?'}): "
            f"rank(s) {_ranks(reached)} at #{top.seq}"
        )
        text += "".join(f", rank {r} at #{s}" for r, s in sorted(behind.items()))
        if behind:
            text += f": rank(s) {_ranks(sorted(behind))} did not reach #{top.seq}"
        if silent:
            text += f"; rank(s) {_ranks(silent)}: unknown (no report)"
        lines.append(text)
    if len(lines) > _MAX_LINES:
        lines = [*lines[:_MAX_LINES], f"  ... and {len(lines) - _MAX_LINES} more groups"]
    return lines


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _group_order(pg: str) -> tuple[int, str]:
    return (int(pg), "") if pg.isdigit() else (1 << 30, pg)
