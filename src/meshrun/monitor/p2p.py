"""Point-to-point operations (pipeline sends/receives) for the hang report.

PyTorch's flight recorder numbers collectives per process group (monitor/collectives.py), but
in torch 2.13 it records no point-to-point operation on Gloo at all: a 2-rank run of send/recv,
isend/irecv and batch_isend_irecv leaves only its collectives in the dump (measured; the
fixture in tests/unit/fixtures/p2p/ is that dump). So meshrun counts them itself, at the one
place every ``torch.distributed.pipelining`` schedule posts them: ``_batch_p2p`` logs each
batch of ``P2POp``s (peer, tensor, group) on the ``torch.distributed.pipelining.schedules``
logger at DEBUG level. A logging filter on that logger reads them; it lets through exactly the
records the logger's previous level let through, so nothing else changes for the user.

Numbering: per direction of a pair, each rank counts the sends it posted to a peer and the
receives it posted from it, 1, 2, 3, ... Sends and receives between two ranks match in order,
so the k-th send from rank a to rank b is the k-th receive on b from a: comparing the counts
of two ranks names the operation that has no partner ("rank 1 waits in recv #12 from rank 0;
rank 0 last sent #11 to rank 1"). Only the schedules' operations are counted (not the first
step's shape exchange, which uses send_object_list on every stage alike).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["P2PRecord", "p2p_lines", "p2p_snapshot", "parse_p2p", "record_pipeline_p2p"]

_LOGGER = "torch.distributed.pipelining.schedules"
_WAITS = (" in _wait_batch_p2p", " in wait")  # a rank's innermost frame while it waits on p2p
_MAX_PAIRS = 8  # pair lines in one report: the disagreements, not a whole pipeline


@dataclass(frozen=True)
class P2PRecord:
    """The newest send to (or receive from) one peer that this rank posted."""

    kind: str  # "send" or "recv"
    peer: int  # global rank
    seq: int  # this rank's count of `kind` operations with `peer` (1 = the first)
    what: str  # the schedule's label: fwd_send, bwd_recv, fwd_send_bwd_recv, ...
    shape: list[int]
    dtype: str
    group: str  # "<name> (<description>)" of the process group, e.g. "1 (mesh_pp)"

    def describe(self) -> str:
        where = "to" if self.kind == "send" else "from"
        size = "x".join(map(str, self.shape)) or "scalar"
        return (
            f"{self.kind} #{self.seq} {where} rank {self.peer} "
            f"({self.what or '?'}, tensor {size} {self.dtype}, group {self.group})"
        )


class _P2PFilter(logging.Filter):
    """Counts the ``P2POp``s of each ``batch_p2p`` record; passes records as before."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger, self._own_level = logger, logger.level  # before meshrun sets DEBUG
        self._lock = threading.Lock()
        self._last: dict[tuple[str, int], P2PRecord] = {}
        self._newest: P2PRecord | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("batch_p2p"):
            args = record.args if isinstance(record.args, tuple) else ()
            what = str(args[0]).rstrip(", ") if len(args) > 1 else ""
            for op in next((a for a in args if isinstance(a, list)), []):
                self._count(op, what)
        return record.levelno >= self._passes_from()

    def _passes_from(self) -> int:
        # What the logger let through without meshrun: its own level if it had one, else its
        # ancestors' (read each time: the user may configure logging later).
        parent = self.logger.parent
        return self._own_level or (parent.getEffectiveLevel() if parent else logging.WARNING)

    def _count(self, op: Any, what: str) -> None:
        kind = getattr(getattr(op, "op", None), "__name__", "")
        if kind not in ("isend", "irecv"):
            return
        kind = kind[1:]
        group = getattr(op, "group", None)
        label = f"{getattr(group, 'group_name', '0')} ({getattr(group, 'group_desc', '')})"
        with self._lock:
            seq = self._last[(kind, op.peer)].seq + 1 if (kind, op.peer) in self._last else 1
            rec = P2PRecord(
                kind,
                int(op.peer),
                seq,
                what,
                list(op.tensor.shape),
                str(op.tensor.dtype).removeprefix("torch."),
                label if group else "default",
            )
            self._last[(kind, rec.peer)] = self._newest = rec

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            last = sorted(self._last.values(), key=lambda r: (r.peer, r.kind))
            newest = self._newest
        info: dict[str, Any] = {
            "last": [asdict(r) for r in last],
            "newest": None if newest is None else [newest.kind, newest.peer],
        }
        if not self.logger.isEnabledFor(logging.DEBUG):  # never a silent gap in the count
            level = logging.getLevelName(self.logger.getEffectiveLevel())
            info["error"] = (
                f"logger {self.logger.name} was set to {level} later: counts may be short"
            )
        return info


_FILTER: _P2PFilter | None = None


def record_pipeline_p2p() -> None:
    """Start counting the pipeline schedules' sends and receives in this process (idempotent).
    Costs a log record per batch of operations, a few per micro-batch."""
    global _FILTER
    if _FILTER is not None:
        return
    logger = logging.getLogger(_LOGGER)
    _FILTER = _P2PFilter(logger)
    logger.addFilter(_FILTER)
    logger.setLevel(logging.DEBUG)


def p2p_snapshot() -> dict[str, Any] | None:
    """This rank's newest operation per (kind, peer), for the hang file; None if not recording."""
    return None if _FILTER is None else _FILTER.snapshot()


@dataclass(frozen=True)
class P2PState:
    """One rank's point-to-point operations, as read back from its hang file."""

    last: dict[tuple[str, int], P2PRecord]
    newest: tuple[str, int] | None
    error: str = ""

    def count(self, kind: str, peer: int) -> int:
        rec = self.last.get((kind, peer))
        return 0 if rec is None else rec.seq


def parse_p2p(header: Mapping[str, Any]) -> P2PState | None:
    """The point-to-point state in one hang file's header (None: not recorded)."""
    info = header.get("p2p")
    if not info:
        return None
    recs = [P2PRecord(**r) for r in info.get("last") or []]
    newest = info.get("newest")
    return P2PState(
        {(r.kind, r.peer): r for r in recs},
        None if newest is None else (newest[0], newest[1]),
        str(info.get("error", "")),
    )


def p2p_lines(
    states: Mapping[int, P2PState], waiting: Mapping[int, str], silent: Sequence[int]
) -> list[str]:
    """Report lines: per reporting rank, the newest send and receive per peer (the newest of all
    "waits in" when its main thread waits on point-to-point work); then every direction of a
    pair whose two ranks posted different counts. ``waiting``: rank -> innermost frame."""
    lines = [
        _rank_line(r, s, waiting.get(r, ""), silent)
        for r, s in sorted(states.items())
        if s.last or s.error
    ]
    if len(lines) == 0:
        return []
    pairs = _mismatches(states)
    if len(pairs) > _MAX_PAIRS:
        pairs = [*pairs[:_MAX_PAIRS], f"  ... and {len(pairs) - _MAX_PAIRS} more pairs"]
    head = "  point-to-point operations (pipeline), numbered per direction of each rank pair:"
    return [head, *lines, *pairs]


def _rank_line(rank: int, state: P2PState, innermost: str, silent: Sequence[int]) -> str:
    waits = any(innermost.endswith(w) for w in _WAITS)
    parts = []
    for key, rec in sorted(state.last.items(), key=lambda kv: kv[0] != state.newest):
        verb = "waits in" if waits and key == state.newest else "posted"
        parts.append(f"{verb} {rec.describe()}")
    peers = sorted({p for _, p in state.last} & set(silent))
    if peers:
        parts.append(f"rank(s) {', '.join(map(str, peers))}: unknown (no report)")
    if state.error:
        parts.append(state.error)
    return f"  rank {rank} p2p: " + "; ".join(parts)


def _mismatches(states: Mapping[int, P2PState]) -> list[str]:
    """Directions a->b, both ranks reporting, where a's sends and b's receives differ."""
    lines = []
    directions = {(r, p) if k == "send" else (p, r) for r, s in states.items() for k, p in s.last}
    for a, b in sorted(directions):
        if a not in states or b not in states:
            continue
        sent, received = states[a].count("send", b), states[b].count("recv", a)
        if sent > received:
            rec = states[a].last[("send", b)]
            first = f"#{received + 1}" + (f"..#{sent}" if sent > received + 1 else "")
            lines.append(
                f"  p2p {a}->{b}: rank {a}'s send {first} ({rec.what}) has no matching recv: "
                f"rank {b} last posted recv #{received} from rank {a}"
            )
        elif received > sent:
            rec = states[b].last[("recv", a)]
            lines.append(
                f"  p2p {a}->{b}: rank {b}'s recv #{sent + 1} ({rec.what}) has no matching send: "
                f"rank {a} last sent #{sent} to rank {b}"
            )
    return lines
