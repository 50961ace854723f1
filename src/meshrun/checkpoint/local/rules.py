"""The pure part of the node-local checkpoint tier: names, the peer mapping, the choice of the
step to restore, retention. No process group and no file I/O here (unit-tested alone).

One node's directory (``checkpoint.local_dir``)::

    <local_dir>/w00004-<config digest>/step_000000120/rank_00003.pt

The first level is the *history*: the world size and the config digest the snapshots were
written under. A restart with another world size or config finds no snapshot of its own
history, so it takes the shared path (and says why). A node holds its own ranks' shards and,
as replicas, the shards of the ranks of the node before it (rank ``r`` sends to
``r + ranks_per_node``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Choice",
    "Held",
    "choose_step",
    "history_name",
    "node_of",
    "parse_history",
    "parse_shard",
    "parse_step",
    "replica_peer",
    "replica_source",
    "shard_name",
    "stale_steps",
    "step_name",
    "superseded",
]

_HISTORY_RE = re.compile(r"^w(\d{5,})-([0-9a-f]+)$")
_STEP_RE = re.compile(r"^step_(\d{9,})$")
_SHARD_RE = re.compile(r"^rank_(\d{5,})\.pt$")


def history_name(world: int, digest: str) -> str:
    return f"w{world:05d}-{digest}"


def parse_history(name: str) -> tuple[int, str] | None:
    m = _HISTORY_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def step_name(step: int) -> str:
    return f"step_{step:09d}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def shard_name(rank: int) -> str:
    """The file of rank ``rank``'s shard, the same on its own node and on its peer's."""
    return f"rank_{rank:05d}.pt"


def parse_shard(name: str) -> int | None:
    """The rank of a finished shard file; a temporary file (being written) gives None."""
    m = _SHARD_RE.match(name)
    return int(m.group(1)) if m else None


# --- peers -----------------------------------------------------------------------------------


def node_of(rank: int, ranks_per_node: int) -> int:
    """The node index of ``rank``: launchers number ranks node by node."""
    return rank // ranks_per_node


def replica_peer(rank: int, world: int, ranks_per_node: int) -> int | None:
    """The rank on the next node that keeps a replica of ``rank``'s shard (None on one node:
    a peer on the same node is lost with it, so there is none)."""
    if world <= ranks_per_node:
        return None
    return (rank + ranks_per_node) % world


def replica_source(rank: int, world: int, ranks_per_node: int) -> int | None:
    """The rank on the node before whose shard ``rank`` keeps (the inverse of the peer)."""
    if world <= ranks_per_node:
        return None
    return (rank - ranks_per_node) % world


# --- the step to restore ---------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """One shard file one rank can read in its node's directory."""

    history: str
    step: int
    shard: int


@dataclass(frozen=True)
class Choice:
    """The agreed restore: ``step`` (None: take the shared path, for ``reason``) and, for each
    rank, the rank whose node holds its shard (itself when its own node does)."""

    step: int | None
    reason: str = ""
    sources: dict[int, int] = field(default_factory=dict)

    def fetched(self) -> list[int]:
        """The ranks whose shard comes from another rank's node."""
        return sorted(r for r, src in self.sources.items() if src != r)


def choose_step(
    seen: Sequence[Iterable[Held]], world: int, history: str, shared_newest: int | None
) -> Choice:
    """The newest step of ``history`` for which every rank's shard is held by some rank (each
    rank's own node first), if it is newer than the newest shared checkpoint. ``seen[q]``: what
    rank ``q`` holds. Every rank computes this from the same gathered lists, so all agree."""
    holders: dict[int, dict[int, set[int]]] = {}  # step -> shard -> ranks that hold it
    others: set[str] = set()
    for rank, held in enumerate(seen):
        for h in held:
            if h.history != history:
                others.add(h.history)
                continue
            holders.setdefault(h.step, {}).setdefault(h.shard, set()).add(rank)
    if not holders:
        return Choice(None, _no_history_reason(others, world))
    complete = [s for s in holders if all(r in holders[s] for r in range(world))]
    if not complete:
        newest = max(holders)
        missing = [r for r in range(world) if r not in holders[newest]]
        return Choice(None, f"no snapshot has every rank's shard (step {newest} lacks {missing})")
    step = max(complete)
    if shared_newest is not None and shared_newest >= step:
        return Choice(
            None,
            f"the shared checkpoint (step {shared_newest}) is as new as the newest node-local "
            f"snapshot (step {step})",
        )
    sources = {r: r if r in holders[step][r] else min(holders[step][r]) for r in range(world)}
    return Choice(step, sources=sources)


def _no_history_reason(others: set[str], world: int) -> str:
    if not others:
        return "no node-local snapshot found"
    worlds = sorted({p[0] for p in map(parse_history, others) if p is not None})
    if worlds and world not in worlds:
        return (
            f"the node-local snapshots are of a world of {', '.join(map(str, worlds))} ranks, "
            f"this run has {world} (the world size changed: the shared checkpoint re-shards)"
        )
    return "the node-local snapshots were written under another config"


# --- retention -------------------------------------------------------------------------------


def stale_steps(steps: Iterable[int], newest: int) -> set[int]:
    """Snapshots to delete once ``newest`` is written everywhere: all but ``newest`` and the one
    before it (kept: a rank killed while writing ``newest`` leaves the previous one as the
    newest common step). Steps after ``newest`` belong to a history this run did not continue."""
    found = set(steps)
    before = [s for s in found if s < newest]
    keep = {newest, *([max(before)] if before else [])}
    return found - keep


def superseded(steps: Iterable[int], resumed: int) -> set[int]:
    """Snapshots to delete after a resume at step ``resumed`` (0: a fresh start): the ones after
    it were written by a run whose later steps are now redone."""
    return {s for s in steps if s > resumed}
