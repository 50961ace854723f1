"""Joins and leaves in a log of small signed entries, beside the one shared state.

torch's rendezvous handler makes every join, leave and move to the wait list a
compare-and-set of the one state that holds all N nodes: a write by any node invalidates
the others' copies, so a round costs each node O(N) tries of O(N) bytes (docs/scale.md).
Here a node's own move is one entry in a log, ``<state key>/log/<slot>``: the node, the round,
where it now is (``part``: a participant; ``wait``: the wait list; ``none``: gone) and its
time, sealed with the job secret over the slot's key and bound to the launch's nonce. A slot is
claimed with a compare-and-set of an empty key; a lost claim answers the entry that won it,
which the writer had to read anyway, so claims cost no extra reads. Readers find the end of
the log with ``check`` (slots are filled in order, never skipped) and read what is new in
one ``multi_get``: each entry once per node, O(N) small values per node per round.

A writer that won a slot sets ``<state key>/end`` to the slot after it: a hint of the log's
end, so that a reader with many new entries checks where it points (is the slot before it
filled, is it empty) instead of galloping through the new slots with a check at each
doubling. The hint is a plain ``set``, unsigned: writers racing can leave it behind the end
and a stranger can set anything, so it is only ever a place to check first; a hint that
does not check out costs the reader two checks more than the gallop it falls back to.

Every node reads every entry: N keys a node and N^2 a round, and the store's ``multi_get``
costs it 0.5 to 1.9 us a key, more the more keys one read asks for (docs/scale.md). So the
node that wins the last slot of a chunk of 64 (``<state key>/log/c<i>``: slots 64i to
64i+63) writes the chunk's entries as one value, if it verified them all (it read every slot
before its own to claim it), and a reader whose new entries cover whole chunks reads those
keys instead (a ``check`` that every one is there, then one ``multi_get``). A chunk is one
JSON document sealed over its own key and bound to the launch's nonce, its entries in slot
order: one MAC and one parse for 64 entries (an entry's own verification was most of an
agent's CPU in a restart, docs/scale.md). A chunk that does not verify, is not 64 entries or
holds one that is not well formed is ignored with one line and its slots read one by one;
a writer holds a slot a stranger filled as unverified, so it writes no chunk over it.

A won write of the shared state appends a mark (``append_mark``): an entry of no node, which
tells the pollers to read the state; a poll with nothing new is one ``check``.

What the handler is handed is the shared state with each node's newest entry applied
(:func:`fold`), as torch's own operations would have applied them. Anything that is not one
node's own move (completing a round, a new round, a node removed as dead) is still a
compare-and-set of the shared state, which then names the first slot not folded into it:
entries before it are never applied again.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, NamedTuple

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from meshrun.launch.trust.sealed import PROBE, SKEW, peek, read_many, unseal_timed
from meshrun.launch.trust.state_json import Nodes, node_of
from meshrun.runtime.secret import JobSecret

PLACES = ("part", "wait", "none")
# Whose a mark entry is (``append_mark``): no node's; folded into no state.
MARK_NODE = _NodeDesc("", 0, 0)
# Slots read in one multi_get (about 1.3 MB at most): with 512, readers in a 1,024-node round
# found the end twice.
_BATCH = 4096
_HINT_DIGITS = 12  # a hint longer than this is not a slot number of this log
_HELP_GAP = 4  # a reader that finds the end this far past the hint sets the hint
# Slots per chunk: the writer of a chunk's last slot writes the chunk as one value for the
# readers (every node reading every entry was N^2 keys a round; 16 chunks cost the store 58 us
# where their 1,024 keys cost 906, benchmarks/store_cost.py).
CHUNK = 64


class Entry(NamedTuple):
    """One verified log entry (a tuple: an agent makes one per entry it reads, N a round)."""

    slot: int
    node: _NodeDesc
    round: int
    place: str
    time: datetime


class JoinLog:
    """The entries this node has read, the newest per node, and the slot after the last."""

    def __init__(
        self,
        call: Callable[..., Any],
        state_key: str,
        secret: JobSecret,
        nonce: str,
        say: Callable[[str], None],
        nodes: Nodes | None = None,
    ) -> None:
        self._call, self._secret, self._nonce, self._say = call, secret, nonce, say
        self._prefix = f"{state_key}/log/"
        self._end_key = f"{state_key}/end"
        self.next = 0  # the first slot not read
        self.newest: dict[_NodeDesc, Entry] = {}
        self.version = 0  # bumped by every entry taken
        self.marks = 0  # the writes of the shared state read of (append_mark)
        self._said: set[int] = set()
        self._held: dict[int, Entry] = {}  # the chunk being filled: its entries (_keep)
        self._nodes: Nodes = {} if nodes is None else nodes  # the backend's (state_json.py)

    def key(self, slot: int) -> str:
        return f"{self._prefix}{slot}"

    def skip_to(self, slot: int) -> None:
        """Entries before ``slot`` are folded into the shared state just read: never read them
        (a node that starts late reads only the round's entries, not the launch's)."""
        self.next = max(self.next, slot)

    def read(self) -> bool:
        """Take the entries written since the last read; whether there were any. One
        ``check`` when there are none."""
        before = self.next
        while True:
            n = self._filled(_BATCH)
            if n == 0:
                return self.next != before
            self._take_range(self.next + n)
            if n < _BATCH:
                return True

    def append(self, node: _NodeDesc, round_: int, place: str, t: datetime) -> Entry:
        """Claim the next free slot for this node's move: a compare-and-set of an empty key.
        A slot another node claimed first answers its entry (taken as a read would); the
        entries written since are then read in one batch, and the claim tried past them:
        when every node moves at once (a restart), retrying slot after slot cost each node
        one operation per node that moved before it."""
        while True:
            slot = self.next
            sealed = self._seal(slot, node, round_, place, t)
            raw = bytes(self._call("compare_set", self.key(slot), "", sealed))
            self.next = slot + 1
            if raw == sealed:
                self._call("set", self._end_key, str(slot + 1))
                entry = Entry(slot, node, round_, place, t)
                self._keep(entry)
                self._write_chunk(slot)
                self._note(entry)
                return entry
            self._take(slot, raw)
            self.read()

    def append_mark(self) -> None:
        """An entry that says the shared state was written: readers read the state when they
        read one (:attr:`marks` grew), so a poll with nothing new is the one ``check`` of the
        log's next slot."""
        self.append(MARK_NODE, -1, "mark", datetime.now(timezone.utc))

    def _filled(self, limit: int) -> int:
        """How many slots from ``next`` hold a value (at most ``limit``): slots are filled in
        order, so a ``check`` of the first answers "none" (a poll with nothing new: one
        operation); then the writers' hint of the end is checked (the slot before it filled,
        its own empty), and a gallop then a halving of ``check``s finds the end where the hint
        is behind or wrong (a ``multi_get`` of a missing key would block). A reader that had
        to gallop far sets the hint to the end it found, for the readers after it: when every
        node moves at once (a restart) the writers' hints land out of order."""
        if not self._has(0):
            return 0
        hint = self._hint() - self.next
        if 1 <= hint <= limit and (hint == 1 or self._has(hint - 1)):
            if hint == limit or not self._has(hint):
                return hint
            count = self._gallop(hint, limit)  # behind the end: gallop on from it
        else:
            count = self._gallop(1, limit)
        if hint > count or count - hint >= _HELP_GAP:
            self._call("set", self._end_key, str(self.next + count))
        return count

    def _has(self, i: int) -> bool:
        return bool(self._call("check", [self.key(self.next + i)]))

    def _hint(self) -> int:
        """The writers' hint of the log's end; 0 when it is missing or not a number (read
        without blocking: a compare-and-set expecting a value never written)."""
        raw = peek(self._call, self._end_key)
        if raw == PROBE or not raw.isdigit() or len(raw) > _HINT_DIGITS:
            return 0
        return int(raw)

    def _gallop(self, known: int, limit: int) -> int:
        """The count of filled slots, knowing ``known`` are: probes at doubling distances, then
        a halving between the last filled probe and the first empty one."""
        step = 1
        while known < limit:
            probe = min(known + step, limit)
            if not self._has(probe - 1):
                return self._halve(known, probe)
            known, step = probe, step * 2
        return known

    def _halve(self, low: int, high: int) -> int:
        """The count of filled slots, knowing ``low`` are and the ``high``-th is not (slot
        ``next + high - 1``; until 2026-12-07 the gallop passed the slot before it, and a
        count one short of a probe was read one short)."""
        while high - low > 1:
            mid = (low + high) // 2
            if self._has(mid - 1):
                low = mid
            else:
                high = mid
        return low

    def _take_range(self, end: int) -> None:
        """Take slots ``next`` to ``end`` (all filled): the whole chunks among them from their
        chunk keys when every one is there (a ``check``, then one ``multi_get`` with the slots
        outside them), else every slot."""
        start = self.next
        chunks = range(start // CHUNK, end // CHUNK)  # chunk i: slots i*CHUNK to (i+1)*CHUNK
        slots: list[int] = list(range(start, end))
        if chunks and self._call("check", [self._chunk_key(i) for i in chunks]):
            tail = range(max(start, chunks.stop * CHUNK), end)
            keys = [self._chunk_key(i) for i in chunks] + [self.key(s) for s in tail]
            values = read_many(self._call, keys)
            unread = [i for i, raw in zip(chunks, values, strict=False) if not self._chunk(i, raw)]
            for slot, raw in zip(tail, values[len(chunks) :], strict=True):
                self._take(slot, raw)
            slots = [s for i in unread for s in range(max(start, i * CHUNK), (i + 1) * CHUNK)]
        if slots:
            values = read_many(self._call, [self.key(s) for s in slots])
            for slot, raw in zip(slots, values, strict=True):
                self._take(slot, raw)
        self.next = end

    def _keep(self, entry: Entry) -> None:
        """Hold a verified entry of the chunk being filled: the writer of its last slot writes
        the chunk (one ``set``) if it holds every entry of it (one writer per chunk, right
        when it is full; readers racing it read the slots)."""
        first = entry.slot - entry.slot % CHUNK
        if any(s < first for s in self._held):
            self._held = {s: e for s, e in self._held.items() if s >= first}
        self._held[entry.slot] = entry

    def _write_chunk(self, slot: int) -> None:
        first = slot + 1 - CHUNK
        if (slot + 1) % CHUNK or any(s not in self._held for s in range(first, slot + 1)):
            return
        rows = [_row(self._held[s]) for s in range(first, slot + 1)]
        key = self._chunk_key(slot // CHUNK)
        doc = json.dumps({"launch": self._nonce, "entries": rows}, separators=(",", ":"))
        self._call("set", key, self._secret.seal(key, doc))

    def _chunk(self, i: int, raw: bytes) -> bool:
        """Take chunk ``i``'s entries from ``next`` on; False, with one line, when it is not
        this log's (then its slots are read one by one)."""
        first = i * CHUNK
        entries = self._chunk_entries(i, raw)
        if entries is None:
            if -1 - i not in self._said:  # chunks' lines under negative numbers, slots' not
                self._said.add(-1 - i)
                self._say(
                    f"ignored the rendezvous log chunk {self._chunk_key(i)}: not {CHUNK} "
                    "entries of this log; its slots are read one by one"
                )
            return False
        for entry in entries[max(0, self.next - first) :]:
            self._note(entry)
        return True

    def _chunk_entries(self, i: int, raw: bytes) -> list[Entry] | None:
        """Chunk ``i``'s entries when it is sealed by this job over its key, in this launch,
        64 well-formed entries none dated ahead of our clock; else None."""
        text = self._secret.unseal(self._chunk_key(i), raw)
        try:
            doc = json.loads(text) if text is not None else None
        except ValueError:
            return None
        if not isinstance(doc, dict) or doc.get("launch") != self._nonce:
            return None
        rows = doc.get("entries")
        if not isinstance(rows, list) or len(rows) != CHUNK:
            return None
        latest = datetime.now(timezone.utc) + SKEW
        entries = []
        for k, row in enumerate(rows):
            entry = self._from_row(i * CHUNK + k, row)
            if entry is None or entry.time > latest:
                return None
            entries.append(entry)
        return entries

    def _from_row(self, slot: int, row: Any) -> Entry | None:
        """A chunk's ``[addr, pid, local id, round, place, time]`` row as the slot's entry."""
        if type(row) is not list or len(row) != 6:
            return None
        addr, pid, local_id, round_, place, when = row
        if type(when) is not str or not _fields_fit([addr, pid, local_id], round_, place):
            return None
        try:
            t = datetime.fromisoformat(when)
        except ValueError:
            return None
        if t.tzinfo is None:
            return None
        return self._entry(slot, node_of(self._nodes, addr, pid, local_id), round_, place, t)

    def _entry(self, slot: int, node: _NodeDesc, round_: int, place: str, t: datetime) -> Entry:
        """A verified entry (the benchmark's agents share equal ones: shared_objects.py)."""
        return Entry(slot, node, round_, place, t)

    def _chunk_key(self, i: int) -> str:
        return f"{self._prefix}c{i}"

    def _take(self, slot: int, raw: bytes) -> None:
        entry = self._verify(slot, raw)
        if entry is not None:
            self._note(entry)
            self._keep(entry)

    def _note(self, entry: Entry) -> None:
        if entry.place == "mark":
            self.marks += 1
            return
        held = self.newest.get(entry.node)
        if held is None or held.slot < entry.slot:
            self.newest[entry.node] = entry
            self.version += 1

    def _verify(self, slot: int, raw: bytes) -> Entry | None:
        key = self.key(slot)
        doc, why = unseal_timed(self._secret, key, raw, self._nonce)
        if doc is not None and not _well_formed(doc):  # signed, so a bug: said, not used
            doc, why = None, "signed but not an entry"
        if why or doc is None:
            if slot not in self._said:
                self._said.add(slot)
                self._say(f"ignored the rendezvous log entry {key}: {why}; the job goes on")
            return None
        node = node_of(self._nodes, *doc["node"])
        return self._entry(slot, node, doc["round"], doc["in"], doc["time"])

    def _seal(self, slot: int, node: _NodeDesc, round_: int, place: str, t: datetime) -> bytes:
        doc = {
            "node": [node.addr, node.pid, node.local_id],
            "round": round_,
            "in": place,
            "time": t.isoformat(),
            "launch": self._nonce,
        }
        return self._secret.seal(self.key(slot), json.dumps(doc))


def fold(base: _RendezvousState, entries: list[Entry]) -> _RendezvousState:
    """``base`` with each node's newest entry applied to the round it names, as torch's
    handler applies a join, a move to the wait list and a leave; a completed round whose
    participants all left becomes the next round, as torch's leave does, and the entries of
    that round are applied to it. ``base`` itself when no entry changes anything."""
    state: _RendezvousState | None = None
    for _ in range(2):  # the base's round, then the next one if every participant left
        mine = [e for e in entries if e.round == (state or base).round]
        if not mine:
            break
        state = state or copy_state(base)
        for entry in mine:
            _apply(state, entry)
        if not (state.complete and not state.participants):
            break
        state.complete = False
        state.round += 1
    return state or base


def own_move(before: _RendezvousState, after: _RendezvousState) -> tuple[_NodeDesc, str] | None:
    """The one node whose place changed and where it now is, when ``after`` differs from
    ``before`` only by that node's place and heartbeat: a join, a move to the wait list, a
    leave, or one dead node dropped. None for anything else (a completed round, a new round,
    two nodes changed). The deadline is not compared: the backend derives it
    (``rendezvous.py``)."""
    if (before.round, before.complete, before.closed) != (
        after.round,
        after.complete,
        after.closed,
    ):
        return None
    if before.redundancy_list != after.redundancy_list:
        return None
    nodes = {*before.last_heartbeats, *after.last_heartbeats, *before.participants}
    nodes |= {*after.participants, *before.wait_list, *after.wait_list}
    moved = [n for n in nodes if _place(before, n) != _place(after, n)]
    if len(moved) != 1:
        return None
    node = moved[0]
    beats = {n: t for n, t in before.last_heartbeats.items() if n != node}
    if beats != {n: t for n, t in after.last_heartbeats.items() if n != node}:
        return None
    place = _place(after, node)
    if place[0] == "part" and place[1] != 0:
        return None  # a rank: only a completed round gives one, and that is not a join
    return node, place[0]


def _place(state: _RendezvousState, node: _NodeDesc) -> tuple[str, int]:
    if node in state.participants:
        return "part", state.participants[node]
    return ("wait", 0) if node in state.wait_list else ("none", 0)


def _apply(state: _RendezvousState, entry: Entry) -> None:
    node = entry.node
    if entry.place == "none":
        state.participants.pop(node, None)
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
        state.last_heartbeats.pop(node, None)
        return
    if entry.place == "part":
        if state.complete:
            return  # too late for this round: the node finds itself out and waits
        state.wait_list.discard(node)
        state.participants[node] = 0
    else:
        state.participants.pop(node, None)
        state.wait_list.add(node)
    held = state.last_heartbeats.get(node)
    state.last_heartbeats[node] = entry.time if held is None else max(held, entry.time)


def copy_state(state: _RendezvousState) -> _RendezvousState:
    out = copy.copy(state)
    out.participants = dict(state.participants)
    out.wait_list = set(state.wait_list)
    out.redundancy_list = set(state.redundancy_list)
    out.last_heartbeats = dict(state.last_heartbeats)
    return out


_MARK = [MARK_NODE.addr, MARK_NODE.pid, MARK_NODE.local_id]


def _row(entry: Entry) -> list[Any]:
    """An entry as a chunk's row (its slot is its place in the chunk)."""
    node = entry.node
    return [node.addr, node.pid, node.local_id, entry.round, entry.place, entry.time.isoformat()]


def _well_formed(doc: dict[str, Any]) -> bool:
    return _fields_fit(doc.get("node"), doc.get("round"), doc.get("in"))


def _fields_fit(node: Any, round_: Any, place: Any) -> bool:
    """An entry's node ``[addr, pid, local id]``, round and place, as a slot's entry or a
    chunk's row carries them."""
    if not (isinstance(node, list) and len(node) == 3):
        return False
    addr, pid, local_id = node
    if not (type(addr) is str and type(pid) is int and type(local_id) is int):
        return False
    if type(round_) is not int:  # not isinstance: True is not a round
        return False
    return place in PLACES or (place == "mark" and node == _MARK)
