"""Joins and leaves as entries in a signed log (launch/trust/joinlog.py), over a real
in-process TCPStore: each node's move is one entry in a slot of its own, readers take each
entry once, a stranger's or another launch's entry is ignored with one line, and the state
handed to torch's handler is the shared state with each node's newest entry applied to its
round, as torch's own join and leave apply them."""

from __future__ import annotations

import json
import pickle
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from meshrun.launch.trust.joinlog import Entry, JoinLog, fold, own_move
from meshrun.launch.trust.rendezvous import Rounds, SignedBackend, forget_store, listen_store
from meshrun.runtime.secret import JobSecret

SECRET = JobSecret(b"0123456789abcdef0123456789abcdef", "test")
NONCE = "0a1b2c3d4e5f6a7b"
KEY = "meshrun.rdzv/job"
A, B, C = (_NodeDesc(f"10.0.0.{i}", 40 + i, 0) for i in (1, 2, 3))
NOW = datetime.now(timezone.utc)


@pytest.fixture
def store() -> Any:
    server = listen_store("127.0.0.1", 0, 60)
    yield server
    forget_store(server)


class Ops:
    """The store, recording each operation's name."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.calls: list[str] = []

    def __getattr__(self, op: str) -> Any:
        call = getattr(self.store, op)

        def counted(*args: Any) -> Any:
            self.calls.append(op)
            return call(*args)

        return counted


def _log(store: Any, said: list[str] | None = None, nonce: str = NONCE) -> JoinLog:
    out = said if said is not None else []

    def call(op: str, *args: Any) -> Any:
        return getattr(store, op)(*args)

    return JoinLog(call, KEY, SECRET, nonce, out.append)


def _complete(*nodes: _NodeDesc) -> _RendezvousState:
    state = _RendezvousState()
    state.complete = True
    state.participants = {n: rank for rank, n in enumerate(nodes)}
    state.last_heartbeats = dict.fromkeys(nodes, NOW)
    return state


def test_every_move_gets_a_slot_of_its_own_and_readers_take_each_entry_once(store: Any) -> None:
    a, b = _log(Ops(store)), _log(store)
    first = a.append(A, 0, "part", NOW)
    second = b.append(B, 0, "part", NOW)  # slot 0 taken: b reads it on the way, claims 1
    assert (first.slot, second.slot) == (0, 1)
    assert set(b.newest) == {A, B}
    for i in range(40):
        b.append(_NodeDesc(f"10.1.0.{i}", i, 0), 0, "part", NOW)
    reader = _log(ops := Ops(store))
    assert reader.read() is True and len(reader.newest) == 42 and reader.next == 42
    # The end found by a gallop of checks, the entries in one multi_get: not one op each.
    assert ops.calls.count("multi_get") == 1 and len(ops.calls) < 16, ops.calls
    ops.calls.clear()
    assert reader.read() is False and ops.calls == ["check"]  # nothing new: one check


def test_a_nodes_newest_entry_wins(store: Any) -> None:
    log = _log(store)
    log.append(A, 0, "part", NOW)
    log.append(A, 0, "none", NOW)
    assert _log(store).read() and _newest(store)[A].place == "none"


def test_a_strangers_entry_and_another_launchs_are_ignored_and_said_once(store: Any) -> None:
    store.set(f"{KEY}/log/0", b"not signed")
    _log(store, nonce="1111222233334444").append(B, 0, "part", NOW)  # slot 1, an earlier launch
    said: list[str] = []
    log = _log(store, said)
    entry = log.append(A, 0, "part", NOW)  # past both
    assert entry.slot == 2 and set(log.newest) == {A}
    assert len(said) == 2 and "not signed with this job's secret" in said[0]
    assert "signed in another launch (nonce 1111222233334444)" in said[1]
    log.read()
    assert len(said) == 2


def test_an_entry_copied_to_another_slot_does_not_verify(store: Any) -> None:
    _log(store).append(A, 0, "none", NOW)
    store.set(f"{KEY}/log/1", store.get(f"{KEY}/log/0"))  # replayed later in the log
    said: list[str] = []
    log = _log(store, said)
    log.read()
    assert log.newest[A].slot == 0 and len(said) == 1


def test_a_completed_round_whose_participants_all_left_is_the_next_round() -> None:
    state = _complete(A, B)
    entries = [
        Entry(0, A, 0, "none", NOW),
        Entry(1, B, 0, "wait", NOW),  # B left, then waits for the next round
        Entry(2, C, 1, "part", NOW),  # C joined the next round
    ]
    got = fold(state, entries)
    assert (got.round, got.complete) == (1, False)
    assert got.participants == {C: 0} and got.wait_list == {B}
    assert state.participants == {A: 0, B: 1}  # the shared state itself is not changed


def test_a_join_too_late_for_a_completed_round_is_not_applied() -> None:
    got = fold(_complete(A, B), [Entry(0, C, 0, "part", NOW)])
    assert got.participants == {A: 0, B: 1}
    # A node that left its round, or moved to the wait list, is out of it in every view.
    got = fold(_complete(A, B), [Entry(0, A, 0, "wait", NOW), Entry(1, C, 3, "part", NOW)])
    assert got.participants == {B: 1} and got.wait_list == {A}


def test_only_one_nodes_own_move_is_an_entry() -> None:
    before = _complete(A, B)
    after = pickle.loads(pickle.dumps(before))
    after.wait_list.add(C)
    after.last_heartbeats[C] = NOW
    assert own_move(before, after) == (C, "wait")
    after.round = 1  # a new round: the shared state's
    assert own_move(before, after) is None
    two = pickle.loads(pickle.dumps(before))
    del two.participants[A], two.participants[B]
    assert own_move(before, two) is None
    ranked = _RendezvousState()
    ranked.participants = {A: 3}
    assert own_move(_RendezvousState(), ranked) is None  # a rank: only a completion gives one


def test_a_round_passed_min_nodes_by_entries_gets_a_deadline(store: Any) -> None:
    """torch sets the last call's deadline in the write that makes the count exactly
    min_nodes; joins read from the log can pass it in one read, and a round without a
    deadline never completes."""
    rounds = Rounds(min_nodes=2, max_nodes=4, last_call=timedelta(seconds=30))
    backend = SignedBackend(store, "job", SECRET, NONCE, say=print, rounds=rounds)
    start = _RendezvousState()
    start.participants, start.last_heartbeats = {A: 0}, {A: NOW}
    assert backend.set_state(pickle.dumps(start)) is not None
    log = _log(store)
    log.read()
    log.append(B, 0, "part", NOW)
    log.append(C, 0, "part", NOW)
    got = backend.get_state()
    assert got is not None
    view = pickle.loads(got[0])
    assert len(view.participants) == 3 and view.deadline is not None
    assert view.deadline > datetime.now(timezone.utc) + timedelta(seconds=20)
    log.append(_NodeDesc("10.0.0.9", 1, 0), 0, "part", NOW)  # max_nodes: complete at once
    view = pickle.loads(backend.get_state()[0])  # type: ignore[index]
    assert view.deadline is not None and view.deadline < datetime.now(timezone.utc)


def test_a_nodes_calls_are_one_at_a_time(store: Any) -> None:
    """torch stops the keep-alive timer without waiting for a keep-alive already running: a
    restart's first calls can meet it in another thread. Two reads of the log at once moved
    its read position past entries neither had read."""
    entered, release = threading.Event(), threading.Event()
    second_in = threading.Event()

    class Blocking(Ops):
        def __getattr__(self, op: str) -> Any:
            call = super().__getattr__(op)

            def blocked(*args: Any) -> Any:
                if threading.current_thread().name == "first" and op == "check":
                    entered.set()
                    release.wait(30)
                if threading.current_thread().name == "second":
                    second_in.set()
                return call(*args)

            return blocked

    backend = SignedBackend(Blocking(store), "job", SECRET, NONCE, say=print)  # type: ignore[arg-type]
    first = threading.Thread(target=backend.get_state, name="first")
    second = threading.Thread(target=backend.get_state, name="second")
    first.start()
    assert entered.wait(30)
    second.start()
    second.join(timeout=0.5)
    assert not second_in.is_set()  # still waiting for the first call to end
    release.set()
    first.join(30)
    second.join(30)
    assert second_in.is_set()


def _newest(store: Any) -> dict[_NodeDesc, Entry]:
    log = _log(store)
    log.read()
    return log.newest


def _filled(store: Any, count: int) -> None:
    writer = _log(store)
    for i in range(count):
        writer.append(_NodeDesc(f"10.2.0.{i}", i, 0), 0, "part", NOW)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 7, 8, 9, 42, 63, 64, 65])
def test_a_reader_takes_every_new_entry_in_one_read_whatever_their_count(
    store: Any, count: int
) -> None:
    _filled(store, count)
    hinted = _log(store)
    assert hinted.read() is True and hinted.next == count
    store.delete_key(f"{KEY}/end")  # no hint: the gallop alone (a count one short of a
    galloping = _log(store)  # probe was read one short until 2026-12-07)
    assert galloping.read() is True and galloping.next == count


def test_the_writers_hint_finds_the_end_in_a_few_checks(store: Any) -> None:
    _filled(store, 300)
    reader = _log(ops := Ops(store))
    assert reader.read() is True and reader.next == 300 and len(reader.newest) == 300
    # check next, the hint, check the slot before it, check its slot: 4; then whether the
    # chunks are there (the writer wrote them), and the read.
    hint = ["check", "compare_set", "check", "check"]
    assert ops.calls == [*hint, "check", "multi_get"], ops.calls


@pytest.mark.parametrize("hint", [b"3", b"299", b"301", b"100000", b"-4", b"x" * 20, b"1" * 40])
def test_a_wrong_hint_costs_checks_never_a_wrong_read(store: Any, hint: bytes) -> None:
    _filled(store, 300)
    store.set(f"{KEY}/end", hint)  # behind the end, past it, or a stranger's nonsense
    reader = _log(ops := Ops(store))
    assert reader.read() is True and reader.next == 300 and len(reader.newest) == 300
    assert ops.calls.count("multi_get") == 1 and len(ops.calls) < 26, ops.calls
    # Set right by the reader where it was far off: the next reader checks it and is done.
    if hint != b"299":
        assert store.get(f"{KEY}/end") == b"300"
        after = _log(ops := Ops(store))
        assert after.read() is True and after.next == 300 and len(ops.calls) == 6, ops.calls


class Keys(Ops):
    """The store, recording the keys each ``multi_get`` asked for."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.read: list[list[str]] = []

    def __getattr__(self, op: str) -> Any:
        call = super().__getattr__(op)
        if op != "multi_get":
            return call

        def keyed(keys: list[str]) -> Any:
            self.read.append(list(keys))
            return call(keys)

        return keyed


def _chunk_key(i: int) -> str:
    return f"{KEY}/log/c{i}"


def test_a_reader_takes_the_chunks_their_last_writers_wrote_in_one_read(store: Any) -> None:
    """Every node read every entry (N keys a node, N^2 a round, about 1.5 us of the store's
    CPU a key). The writer of a chunk's last slot writes the chunk's 64 values as one; a
    reader reads 4 chunk keys and the 44 slots past them, not 300 slots."""
    writer = _log(store)
    _append(writer, range(10))
    behind = _log(store)
    assert behind.read() is True and behind.next == 10  # mid-chunk from here on
    _append(writer, range(10, 300))
    assert store.check([_chunk_key(i) for i in range(4)]) and not store.check([_chunk_key(4)])
    reader = _log(keys := Keys(store))
    assert reader.read() is True and reader.next == 300
    slots = [f"{KEY}/log/{s}" for s in range(256, 300)]
    assert keys.read == [[_chunk_key(i) for i in range(4)] + slots], keys.read
    assert behind.read() is True and behind.next == 300
    assert reader.newest == behind.newest == _newest(store) and len(reader.newest) == 300


def _chunk_doc(store: Any, i: int) -> dict[str, Any]:
    raw = bytes(store.get(_chunk_key(i)))
    text = SECRET.unseal(_chunk_key(i), raw)
    assert text is not None
    doc: dict[str, Any] = json.loads(text)
    return doc


@pytest.mark.parametrize("forged", ["junk", "chunk 1's", "another launch's", "short", "future"])
def test_a_chunk_that_is_not_the_logs_is_ignored_once_and_its_slots_read(
    store: Any, forged: str
) -> None:
    """A chunk is sealed over its own key and bound to the launch: a stranger cannot hide,
    reorder or replace entries by writing one, nor move a chunk to another's key; one that is
    not 64 entries or names a time ahead of the clock is not taken either."""
    _filled(store, 128)
    doc = _chunk_doc(store, 0)
    future = [*doc["entries"][5][:5], (NOW + timedelta(hours=1)).isoformat()]

    def sealed(d: dict[str, Any]) -> bytes:
        return SECRET.seal(_chunk_key(0), json.dumps(d))

    store.set(
        _chunk_key(0),
        {
            "junk": b"not a chunk",
            "chunk 1's": bytes(store.get(_chunk_key(1))),
            "another launch's": sealed({**doc, "launch": "another-launch"}),
            "short": sealed({**doc, "entries": doc["entries"][:63]}),
            "future": sealed(
                {**doc, "entries": [*doc["entries"][:5], future, *doc["entries"][6:]]}
            ),
        }[forged],
    )
    said: list[str] = []
    reader = _log(store, said)
    assert reader.read() is True and reader.next == 128 and len(reader.newest) == 128
    assert reader.newest == _newest_by_slots(store, 128)
    assert len(said) == 1 and _chunk_key(0) in said[0] and "read one by one" in said[0], said


def _newest_by_slots(store: Any, count: int) -> dict[_NodeDesc, Entry]:
    """Every slot's entry, verified one by one (no chunk read)."""
    log = _log(store)
    for slot, raw in enumerate(store.multi_get([f"{KEY}/log/{s}" for s in range(count)])):
        log._take(slot, bytes(raw))
    return log.newest


def test_a_chunk_holds_what_its_slots_hold(store: Any) -> None:
    _filled(store, 64)
    reader = _log(keys := Keys(store))
    assert reader.read() is True and keys.read == [[_chunk_key(0)]], keys.read
    assert reader.newest == _newest_by_slots(store, 64)
    rows = _chunk_doc(store, 0)["entries"]
    assert rows[3] == ["10.2.0.3", 3, 0, 0, "part", NOW.isoformat()]


def test_a_chunk_with_a_strangers_entry_is_not_written(store: Any) -> None:
    """A slot a stranger filled is ignored by each reader with a line of its own: a chunk
    carrying it would hide that from the readers after."""
    writer = _log(store)
    _append(writer, range(10))
    store.set(f"{KEY}/log/10", b"a stranger's value")
    _append(writer, range(10, 63))  # slots 11 to 63: the last slot of chunk 0 is its
    said: list[str] = []
    reader = _log(store, said)
    assert reader.read() is True and reader.next == 64 and len(reader.newest) == 63
    assert not store.check([_chunk_key(0)]) and len(said) == 1, said


def _append(writer: JoinLog, numbers: range) -> None:
    for i in numbers:
        writer.append(_NodeDesc(f"10.2.0.{i}", i, 0), 0, "part", NOW)
