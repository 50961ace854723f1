"""Every node's newest heartbeat in one signed value, refreshed by one node at a time.

Each node's keep-alive is a key of its own (``heartbeats.py``); a node that held a peer's
heartbeat near the dead-node limit read that peer's key. At 1,024 simulated nodes every node
read about every peer's key a few times a round and every 7.5 s while the workers trained: N
keys per node, N^2 per refresh, and a ``multi_get`` of 1,024 keys costs the store about 60
times what one read of the 40 KiB digest does (docs/scale.md). Here one node reads all
the keys and writes what it verified as one value, ``<state key>/hbd``; the others read that
value (one operation, O(N) bytes at about 0.3 ns a byte) and read keys themselves only for
the nodes it leaves near the limit (the dead ones, or all of them when no digest comes).

Who refreshes it: whichever node first claims the next refresh, a compare-and-set of
``<state key>/hbd.claim`` from the claim the current digest names (empty before the first) to
its own. The others lose the compare-and-set and read the winner's digest. A claim whose digest
never came (its node died, or a stranger wrote the claim key) is taken over once it is a
keep-alive interval old: a dead claimer stops the refreshes for that long, and nodes near the
limit read their keys themselves meanwhile.

The digest is sealed with the job secret over its key and bound to the launch's nonce: a
stranger cannot write one; one deleted, replaced by junk or from another launch is ignored
(one line) and costs only the refreshes it stopped. A digest replayed from earlier in this
launch holds older times, and a node keeps the newest time it verified.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

from meshrun.launch.trust.sealed import PROBE, SKEW, peek, unseal_timed
from meshrun.launch.trust.state_json import Nodes, node_of
from meshrun.runtime.secret import JobSecret, sanitize


class BeatDigest:
    """This node's reads and writes of the heartbeat digest and its claim."""

    def __init__(
        self,
        call: Callable[..., Any],
        state_key: str,
        secret: JobSecret,
        nonce: str,
        keep_alive: timedelta,
        say: Callable[[str], None],
        nodes: Nodes | None = None,
    ) -> None:
        self._call, self._secret, self._nonce, self._say = call, secret, nonce, say
        self._nodes: Nodes = {} if nodes is None else nodes  # the backend's (state_json.py)
        self.key, self._claim_key = f"{state_key}/hbd", f"{state_key}/hbd.claim"
        self._keep_alive_s = keep_alive.total_seconds()
        self._me, self._claims = secrets.token_hex(6), 0
        self._raw = PROBE  # the digest value last read (PROBE: none)
        self._claimed = ""  # the claim the newest verified digest names: the next one's expected
        self._blocked: tuple[bytes, float] | None = None  # a claim lost to, first seen when
        self._said: set[str] = set()
        self._made: datetime | None = None  # when the newest verified digest was written

    def read(self) -> dict[_NodeDesc, datetime]:
        """The digest's times when it changed since the last read and verifies; else none."""
        raw = peek(self._call, self.key)
        if raw == self._raw:
            return {}
        self._raw = raw
        if raw == PROBE:
            return {}
        doc, why = unseal_timed(self._secret, self.key, raw, self._nonce)
        if doc is None or not isinstance(doc.get("claim"), str):
            self._ignore(why or "not a heartbeat digest")
            return {}
        beats = _beats(doc.get("beats"), self._nodes)
        if beats is None:
            self._ignore("not a heartbeat digest")
            return {}
        self._claimed, self._made = doc["claim"], doc["time"]
        return beats

    def age(self) -> timedelta:
        """How old the newest verified digest is by this node's clock (the dead-node rule
        compares heartbeat times across clocks already); forever when none came."""
        if self._made is None:
            return timedelta.max
        return datetime.now(timezone.utc) - self._made

    def claim(self) -> bool:
        """Whether this node won the next refresh (then it must :meth:`publish`)."""
        self._claims += 1
        want = f"{self._me}.{self._claims}".encode()
        got = bytes(self._call("compare_set", self._claim_key, self._claimed, want))
        if self._claimed and got == self._claimed.encode():
            # A missing key answers the value expected: the claim key was deleted. Made anew.
            got = bytes(self._call("compare_set", self._claim_key, "", want))
        if got == want:
            self._blocked = None
            return True
        now = time.monotonic()
        if self._blocked is None or self._blocked[0] != got:
            self._blocked = (got, now)  # another node's claim: its digest should follow
            return False
        if now - self._blocked[1] < self._keep_alive_s:
            return False
        # The same claim a keep-alive later and no digest naming it: its node died before
        # writing one, or the key holds a stranger's value. Taken over.
        got = bytes(self._call("compare_set", self._claim_key, got, want))
        self._blocked = None if got == want else (got, now)
        return got == want

    def publish(self, beats: Iterable[tuple[_NodeDesc, datetime]]) -> None:
        """Write the digest of this node's claim: ``beats``, each a time this node verified."""
        claim, made = f"{self._me}.{self._claims}", datetime.now(timezone.utc)
        doc = {
            "launch": self._nonce,
            "time": made.isoformat(),
            "claim": claim,
            # Seconds rounded down to the millisecond: never newer than the time verified.
            "beats": [
                [n.addr, n.pid, n.local_id, math.floor(t.timestamp() * 1e3)] for n, t in beats
            ],
        }
        raw = self._secret.seal(self.key, json.dumps(doc, separators=(",", ":")))
        self._call("set", self.key, raw)
        self._raw, self._claimed, self._made = raw, claim, made

    def _ignore(self, why: str) -> None:
        kind = why.split(" (")[0]
        if kind not in self._said:
            self._said.add(kind)
            self._say(
                f"ignored the rendezvous heartbeat digest {self.key}: {sanitize(why, 160)}; "
                "nodes read the heartbeat keys themselves until a signed one comes"
            )


def _beats(raw: Any, nodes: Nodes) -> dict[_NodeDesc, datetime] | None:
    """The digest's ``[addr, pid, local id, ms]`` rows as times, or None if malformed; a time
    ahead of our clock by more than the skew allowed is left out."""
    if not isinstance(raw, list):
        return None
    out: dict[_NodeDesc, datetime] = {}
    # Every node's row at each read, N a read: plain type checks, no call per field.
    latest_ms = (datetime.now(timezone.utc) + SKEW).timestamp() * 1e3
    utc = timezone.utc
    for row in raw:
        if type(row) is not list or len(row) != 4:
            return None
        addr, pid, local_id, ms = row
        if type(addr) is not str or type(pid) is not int or type(local_id) is not int:
            return None
        if type(ms) is not int or ms < 0:
            return None
        if ms > latest_ms:
            continue
        out[node_of(nodes, addr, pid, local_id)] = datetime.fromtimestamp(ms / 1e3, utc)
    return out
