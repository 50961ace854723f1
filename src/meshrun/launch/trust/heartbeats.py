"""Each node's rendezvous heartbeat in a signed key of its own, beside the shared state.

torch's rendezvous handler writes a node's keep-alive into the one shared state every
keep-alive interval: N nodes make N / interval compare-and-sets a second of a value that holds
all N, each lost and retried whenever another write came first. At 128 simulated nodes on 2
cores no round completed: heartbeats aged past the dead-node limit before their write won
(docs/scale.md). Here a keep-alive is one plain ``set`` of the node's own key
(``<state key>/hb/<addr>_<pid>_<local id>``: the node, its time and the launch nonce, sealed
with the job secret over the key's name), and a reader merges the newest verified time of each
node into the state it hands to torch's handler, whose dead-node rule (``_sanitize``) is
unchanged.

A node reads the digest of every node's heartbeat (``beat_digest.py``) once a heartbeat it
holds is an interval from the handler's dead-node limit, and the keys themselves (in
``multi_get``s of 256) when it won the digest's next refresh, or for the nodes still half an
interval from the limit after the digest: at most once per half interval. A key that does
not verify (a stranger's, another launch's, dated in the future) is ignored with one line; a
deleted key is never waited on (the store's ``get`` would block until its timeout): the node
keeps the newest time already seen, or the shared state's.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from meshrun.launch.trust.beat_digest import BeatDigest
from meshrun.launch.trust.sealed import read_many, unseal_timed
from meshrun.launch.trust.state_json import Nodes
from meshrun.runtime.secret import JobSecret, sanitize

# The keys are read at most once per this share of the keep-alive interval: a live node's key
# is then read at least once between "near the limit" and the limit itself.
REFRESH_SHARE = 0.5
_NEVER = datetime.min.replace(tzinfo=timezone.utc)


class Heartbeats:
    """The newest verified heartbeat of every node this backend has met, and its keys."""

    def __init__(
        self,
        call: Callable[..., Any],
        state_key: str,
        secret: JobSecret,
        nonce: str,
        keep_alive: timedelta,
        tries: int,
        say: Callable[[str], None],
        nodes: Nodes | None = None,
    ) -> None:
        self._call, self._secret, self._nonce, self._say = call, secret, nonce, say
        self._prefix = f"{state_key}/hb/"
        # Read the keys once a heartbeat is this old: the handler calls a node dead at
        # keep_alive x tries, and a live node writes at least once per two intervals.
        self._stale_after = keep_alive * tries - keep_alive / 2
        # The digest is looked at half an interval before that: a refresh claimed then, or
        # the winner's digest, comes before any node's key must be read.
        self._digest_after = max(self._stale_after - keep_alive / 2, keep_alive / 2)
        self._fresh = keep_alive / 2  # a digest younger than this is not refreshed
        self._digest = BeatDigest(call, state_key, secret, nonce, keep_alive, say, nodes)
        self._keep_alive = keep_alive
        self._keyed: dict[_NodeDesc, datetime] = {}  # the time this backend last wrote each key
        self._seen: dict[_NodeDesc, datetime] = {}
        self._read_at = -math.inf
        self._absent: dict[str, float] = {}  # a key found missing -> when
        self._said: set[tuple[str, str]] = set()
        # The last shared state merged, its nodes' held times newer than its own, and the
        # nodes whose held time grew since (merged in at the next call). torch's node type
        # hashes in Python: a pass over every node at each poll was most of an agent's CPU
        # (docs/scale.md), so only a new state costs one.
        self._base: _RendezvousState | None = None
        self._newer: dict[_NodeDesc, datetime] = {}
        self._grown: list[_NodeDesc] = []
        self._merged: _RendezvousState | None = None
        self._oldest: datetime | None = None

    def key(self, node: _NodeDesc) -> str:
        return f"{self._prefix}{node.addr}_{node.pid}_{node.local_id}"

    def write(self, state: _RendezvousState, joining: bool = False) -> int:
        """Sign and store the heartbeat of each node whose time in ``state`` is newer than
        any seen (a keep-alive: this node's only); one store operation, or none. ``joining``:
        the state carrying the time was just written (never before: a lost write must leave
        no heartbeat), and a key written in the last half interval is recent enough."""
        gap = self._keep_alive / 2 if joining else timedelta(0)
        fresh = {
            n: t
            for n, t in state.last_heartbeats.items()
            if t > self._seen.get(n, _NEVER) and t - self._keyed.get(n, _NEVER) > gap
        }
        if not fresh:
            return 0
        keys = [self.key(n) for n in fresh]
        values = [self._seal(k, n, t) for k, (n, t) in zip(keys, fresh.items(), strict=True)]
        if len(keys) == 1:
            self._call("set", keys[0], values[0])
        else:
            self._call("multi_set", keys, values)
        self._keyed.update(fresh)
        self._note(fresh.items())
        return len(keys)

    def merge(self, base: _RendezvousState) -> _RendezvousState:
        """``base`` (the verified shared state) with each node's heartbeat the newest of its
        own and its key's; ``base`` itself when no key is newer. Not changed in place."""
        if base is not self._base:
            self._absorb(base)
        self._build()
        if self._due():
            self._refresh()
            self._build()
        assert self._merged is not None
        return self._merged

    def _absorb(self, base: _RendezvousState) -> None:
        """A new shared state: its times noted, and the held times newer than its own, in one
        pass over its nodes (one lookup each)."""
        seen, newer = self._seen, {}
        for node, t in base.last_heartbeats.items():
            held = seen.get(node)
            if held is None or t > held:
                seen[node] = t
            elif held > t:
                newer[node] = held
        self._base, self._newer, self._grown, self._merged = base, newer, [], None

    def _build(self) -> None:
        """The merged view, made anew when the shared state or a held time changed."""
        base = self._base
        assert base is not None
        if self._merged is not None and not self._grown:
            return
        beats = base.last_heartbeats
        for node in self._grown:
            t = beats.get(node)
            if t is not None and self._seen[node] > t:
                self._newer[node] = self._seen[node]
        self._grown = []
        self._merged = base
        if self._newer:
            self._merged = copy.copy(base)
            self._merged.last_heartbeats = {**beats, **self._newer}
        self._oldest = min(self._merged.last_heartbeats.values(), default=None)

    def _due(self) -> bool:
        """Whether to look for newer heartbeats: one held is near the handler's dead-node
        limit (the digest, or the node's key, may hold a newer one), and the last look is
        ``REFRESH_SHARE`` of an interval old."""
        every = self._keep_alive.total_seconds() * REFRESH_SHARE
        if self._oldest is None or time.monotonic() - self._read_at < every:
            return False
        return datetime.now(timezone.utc) - self._oldest >= self._digest_after

    def _refresh(self) -> None:
        """The digest first (one read). If it leaves a node near the limit and is itself half
        an interval old, this node claims the next refresh: the winner reads every node's key
        and writes the digest, the others read it again (the winner's, if it came already).
        A node still past ``_stale_after`` has its key read by this node itself (a dead node,
        a digest that does not come)."""
        self._read_at = time.monotonic()
        if self._older(self._digest_after):  # else only the view was older: none to read
            self._note(self._digest.read().items())
            if not self._refreshed() and (urgent := self._older(self._stale_after)):
                self._read(urgent)

    def _refreshed(self) -> bool:
        """Whether this node just read every node's key and wrote the digest: it claims the
        refresh when the digest leaves a node near the limit and is half an interval old; a
        claim lost, it reads the digest again (the winner's, if it came already)."""
        # A digest younger than half an interval is the newest there is: a node it leaves
        # near the limit wrote nothing since (a refresh per stale node, each reader's due
        # time its own, made every node read every key in turn).
        if not self._older(self._digest_after) or self._digest.age() < self._fresh:
            return False
        if not self._digest.claim():
            self._note(self._digest.read().items())
            return False
        assert self._base is not None
        nodes = list(self._base.last_heartbeats)
        self._read(nodes)  # every key: none is left for this node to read after
        self._digest.publish((n, self._seen[n]) for n in nodes)
        return True

    def _older(self, age: timedelta) -> list[_NodeDesc]:
        """The shared state's nodes whose newest held time is ``age`` old: those of the merged
        view, checked against the times held since it was built."""
        assert self._merged is not None
        limit = datetime.now(timezone.utc) - age
        beats = self._merged.last_heartbeats.items()
        return [n for n, t in beats if t <= limit and self._seen[n] <= limit]

    def _note(self, items: Iterable[tuple[_NodeDesc, datetime]]) -> None:
        seen, grown = self._seen, self._grown
        for node, t in items:
            held = seen.get(node)
            if held is None or t > held:
                seen[node] = t
                grown.append(node)

    # --- reading the keys ---------------------------------------------------------------

    def _read(self, nodes: list[_NodeDesc]) -> None:
        """The nodes' keys in ``multi_get``s of 256 (after one ``check``: a missing key would
        block the read until the store's timeout); verified times noted, others said."""
        now = self._read_at = time.monotonic()
        # A key found missing is left out for one keep-alive interval: looking for each key
        # with a check of its own at every read, when one was missing, made O(N) operations
        # per node per read (256 simulated nodes, docs/scale.md).
        every = self._keep_alive.total_seconds()
        self._absent = {k: at for k, at in self._absent.items() if now - at < every}
        keys = {self.key(n): n for n in nodes if self.key(n) not in self._absent}
        try:
            present = list(keys)
            if present and not self._call("check", present):  # missing: one check each
                present = [k for k in keys if self._call("check", [k])]
                for k in set(keys) - set(present):
                    self._absent[k] = now
                    self._ignore(k, "deleted from the store")
            values = read_many(self._call, present)
        except RendezvousConnectionError as err:  # deleted between check and read: go on
            self._ignore(self._prefix + "*", f"unreadable ({sanitize(str(err), 160)})")
            return
        for k, raw in zip(present, values, strict=True):
            t = self._verify(k, keys[k], raw)
            if t is not None:
                self._note([(keys[k], t)])

    def _verify(self, key: str, node: _NodeDesc, raw: bytes) -> datetime | None:
        doc, why = unseal_timed(self._secret, key, raw, self._nonce)
        if doc is not None and doc.get("node") != [node.addr, node.pid, node.local_id]:
            # Signed by this job, for another node: a node's own heartbeat copied onto
            # this key would keep this one alive.
            named = sanitize(str(doc.get("node")), 80)
            why = f"signed for another node ({named}), not {node.addr}:{node.pid}"
        if why or doc is None:
            self._ignore(key, why)
            return None
        t: datetime = doc["time"]
        return t

    def _ignore(self, key: str, why: str) -> None:
        """One line per key and reason: the node keeps the newest time already seen."""
        kind = why.split(" (")[0]
        if (key, kind) not in self._said:
            self._said.add((key, kind))
            self._say(
                f"ignored the rendezvous heartbeat {key}: {why}; the node keeps its last "
                "verified time (the one in the signed state, or an older heartbeat)"
            )

    def _seal(self, key: str, node: _NodeDesc, t: datetime) -> bytes:
        doc = {"node": [node.addr, node.pid, node.local_id], "time": t.isoformat()}
        return self._secret.seal(key, json.dumps({**doc, "launch": self._nonce}))


def only_heartbeats(before: _RendezvousState, after: _RendezvousState) -> bool:
    """Whether ``after`` is ``before`` with newer heartbeats only (torch's keep-alive)."""

    def rest(s: _RendezvousState) -> tuple[Any, ...]:
        lists = (s.participants, s.wait_list, s.redundancy_list, s.last_heartbeats.keys())
        return (s.round, s.complete, s.deadline, s.closed, *lists)

    if rest(before) != rest(after):
        return False
    return all(t >= before.last_heartbeats[n] for n, t in after.last_heartbeats.items())
