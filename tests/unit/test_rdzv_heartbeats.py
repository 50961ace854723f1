"""Each node's rendezvous heartbeat in a signed key of its own (launch/trust/heartbeats.py),
over a real in-process TCPStore and torch's own state holder: a keep-alive is one small
``set``; a heartbeat from a stranger, another launch or the future is ignored; a deleted key
neither blocks nor kills; torch's dead-node rule still finds a node whose heartbeat stopped.
Time is driven by the heartbeats' values, never by sleeping."""

from __future__ import annotations

import json
import pickle
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from meshrun.launch.trust import heartbeats
from meshrun.launch.trust.rendezvous import SignedBackend, forget_store, listen_store
from meshrun.runtime.secret import JobSecret

SECRET = JobSecret(b"0123456789abcdef0123456789abcdef", "test")
OTHER = JobSecret(b"fedcba9876543210fedcba9876543210", "other")
NONCE = "0a1b2c3d4e5f6a7b"
KEY = "meshrun.rdzv/job"
A, B = _NodeDesc("10.0.0.1", 42, 0), _NodeDesc("10.0.0.2", 7, 1)
C = _NodeDesc("10.0.0.4", 5, 0)
A_KEY, B_KEY = (f"{KEY}/hb/{n.addr}_{n.pid}_{n.local_id}" for n in (A, B))
DIGEST, CLAIM = f"{KEY}/hbd", f"{KEY}/hbd.claim"
KEEP_ALIVE, TRIES = timedelta(seconds=1), 3  # torch calls a node dead 3 s after its heartbeat


@pytest.fixture
def store() -> Any:
    server = listen_store("127.0.0.1", 0, 60)  # a read blocked on a missing key: a minute
    yield server
    forget_store(server)


@pytest.fixture(autouse=True)
def every_read_looks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heartbeats, "REFRESH_SHARE", 0.0)  # keys read whenever one is stale


class Ops:
    """The store, recording each operation and its first argument."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, []

    def __getattr__(self, op: str) -> Any:
        call = getattr(self.store, op)

        def counted(*args: Any) -> Any:
            self.calls.append((op, args[0] if args else None))
            return call(*args)

        return counted


def _backend(
    store: Any, said: list[str] | None = None, keep_alive: timedelta = KEEP_ALIVE
) -> SignedBackend:
    out = said if said is not None else []
    return SignedBackend(store, "job", SECRET, NONCE, keep_alive, TRIES, say=out.append)


def _ago(seconds: float) -> datetime:
    return datetime.now(timezone.utc) - timedelta(seconds=seconds)


def _two_nodes(a_at: datetime, b_at: datetime) -> _RendezvousState:
    state = _RendezvousState()
    state.round, state.complete, state.participants = 1, True, {A: 0, B: 1}
    state.last_heartbeats = {A: a_at, B: b_at}
    return state


def _sealed(
    key: str, node: _NodeDesc, at: datetime, nonce: str = NONCE, secret: Any = SECRET
) -> bytes:
    doc = {"node": [node.addr, node.pid, node.local_id], "time": at.isoformat(), "launch": nonce}
    return secret.seal(key, json.dumps(doc))


def _no_digest(store: Any) -> None:
    """Forget the digest a test's first writer made (it read the keys before the test wrote
    them) and its claim: the next reader makes the first."""
    for key in (DIGEST, CLAIM):
        store.delete_key(key)


def _beats(backend: SignedBackend) -> dict[_NodeDesc, datetime]:
    got = backend.get_state()
    assert got is not None
    return pickle.loads(got[0]).last_heartbeats


def _survivors(backend: SignedBackend, keep_alive: timedelta = KEEP_ALIVE) -> set[_NodeDesc]:
    """The participants torch's own state holder keeps after one sync (its ``_sanitize``)."""
    settings = RendezvousSettings("job", 1, 2, RendezvousTimeout(), keep_alive, TRIES)
    holder = _BackendRendezvousStateHolder(backend, settings, cache_duration=0)
    holder.sync()
    return set(holder.state.participants)


@pytest.mark.timeout(30)
def test_a_keep_alive_is_one_set_of_the_nodes_own_key_and_others_see_it(store: Any) -> None:
    """torch's keep-alive wrote the one shared state (every node's, O(N) bytes) every interval:
    at 128 simulated nodes heartbeats aged past the dead-node limit before their write won."""
    ops = Ops(store)
    mine = _backend(ops)
    first = mine.set_state(pickle.dumps(_two_nodes(_ago(10), _ago(1))))
    assert first is not None and first[2] is True
    shared = bytes(store.get(KEY))
    state = pickle.loads(first[0])
    beat = datetime.now(timezone.utc)
    state.last_heartbeats[A] = beat  # what torch's _keep_alive does, then sync()
    ops.calls.clear()
    kept = mine.set_state(pickle.dumps(state), first[1])
    assert kept is not None and kept[1:] == (first[1], True)
    assert ops.calls == [("set", A_KEY)] and bytes(store.get(KEY)) == shared
    assert len(bytes(store.get(A_KEY))) < 200  # O(1) bytes, whatever the node count
    assert pickle.loads(kept[0]).last_heartbeats[A] == beat
    # Another node reads the unchanged shared state and the key's newer time.
    assert _beats(_backend(store))[A] == beat


@pytest.mark.timeout(30)
def test_a_join_writes_the_shared_state_then_the_keys(store: Any) -> None:
    ops = Ops(store)
    first = _backend(ops).set_state(pickle.dumps(_two_nodes(_ago(0), _ago(0))))
    assert first is not None and first[2] is True
    assert [op for op, _ in ops.calls[-4:]] == ["compare_set", "multi_set", "compare_set", "set"]
    assert ops.calls[-4][1] == KEY  # then the keys, then the pollers' mark: a log entry
    assert ops.calls[-2][1] == f"{KEY}/log/0" and ops.calls[-1][1] == f"{KEY}/end"


@pytest.mark.timeout(30)
def test_a_stopped_heartbeat_is_still_found_dead_by_torchs_handler(store: Any) -> None:
    """B's shared time is old; its key decides: signed 0.5 s ago it lives, 4 s ago (past
    1 s x 3 tries) torch's own _sanitize removes it."""
    writer = _backend(store)
    assert writer.set_state(pickle.dumps(_two_nodes(_ago(0), _ago(10)))) is not None
    store.set(B_KEY, _sealed(B_KEY, B, _ago(0.5)))
    assert _survivors(_backend(store)) == {A, B}
    store.set(B_KEY, _sealed(B_KEY, B, _ago(4)))
    store.delete_key(DIGEST)  # it holds the 0.5 s time the first reader verified
    assert _survivors(_backend(store)) == {A}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("forged", "why"),
    [
        (lambda: _sealed(B_KEY, B, _ago(0), secret=OTHER), "not signed with this job's secret"),
        (lambda: _sealed(B_KEY, B, _ago(0), nonce="1111222233334444"), "another launch"),
        (lambda: _sealed(B_KEY, A, _ago(0)), "signed for another node"),  # A's time on B's key
        (lambda: _sealed(B_KEY, B, _ago(-3600)), "dated in the future"),
    ],
    ids=["stranger", "other-launch", "other-node", "future"],
)
def test_a_forged_heartbeat_is_ignored_once_and_the_node_still_dies(
    store: Any, forged: Any, why: str
) -> None:
    assert _backend(store).set_state(pickle.dumps(_two_nodes(_ago(0), _ago(10)))) is not None
    store.set(B_KEY, forged())
    said: list[str] = []
    reader = _backend(store, said)
    assert _beats(reader)[B] < _ago(9)  # the shared state's time, not the forged one
    assert _survivors(reader) == {A}
    _beats(reader)
    assert len(said) == 1 and why in said[0] and B_KEY in said[0], said


@pytest.mark.timeout(30)
def test_a_deleted_heartbeat_key_neither_blocks_nor_kills(store: Any) -> None:
    """The store's read of a missing key blocks until its timeout (a minute here, past this
    test's): the keys are checked first; the node keeps its newest verified time. Here a node
    is dead 30 s after its heartbeat and its key is read again once 25 s old: B's, signed 26 s
    ago, is read at every read of this reader."""
    keep_alive = timedelta(seconds=10)
    assert _backend(store).set_state(pickle.dumps(_two_nodes(_ago(0), _ago(40)))) is not None
    signed = _ago(26)
    store.set(B_KEY, _sealed(B_KEY, B, signed))
    _no_digest(store)
    said: list[str] = []
    reader = _backend(store, said, keep_alive)
    assert _beats(reader)[B] == signed
    store.delete_key(B_KEY)
    assert _beats(reader)[B] == signed and _survivors(reader, keep_alive) == {A, B}
    assert len(said) == 1 and f"{B_KEY}: deleted from the store" in said[0], said
    # A node that never saw B's key holds the time the reader verified, from its digest...
    held = _beats(_backend(store, None, keep_alive))[B]
    assert signed - timedelta(milliseconds=1) < held <= signed  # to the millisecond, not later
    # ...and, with no digest either, the shared state's time for B: dead.
    store.delete_key(DIGEST)
    assert _survivors(_backend(store, None, keep_alive), keep_alive) == {A}


@pytest.mark.timeout(30)
def test_a_keep_alive_hands_back_the_others_newest_heartbeats(store: Any) -> None:
    """torch's handler calls nodes dead on the state a keep-alive hands back: its own older
    copy would have B's heartbeat of its last read, past the limit under a loaded machine."""
    store.set(B_KEY, _sealed(B_KEY, B, _ago(10)))
    mine = _backend(store)
    first = mine.set_state(pickle.dumps(_two_nodes(_ago(1), _ago(10))))
    assert first is not None and pickle.loads(first[0]).last_heartbeats[B] < _ago(9)
    beat = _ago(0)
    store.set(B_KEY, _sealed(B_KEY, B, beat))  # B's own keep-alive, since A's last read
    state = pickle.loads(first[0])
    state.last_heartbeats[A] = _ago(0)
    kept = mine.set_state(pickle.dumps(state), first[1])
    assert kept is not None and kept[1:] == (first[1], True)
    assert pickle.loads(kept[0]).last_heartbeats[B] == beat


@pytest.mark.timeout(30)
def test_a_lost_write_leaves_no_heartbeat_behind(store: Any) -> None:
    """A's own heartbeat aged past the limit (its agent starved): torch's holder dropped A, and
    the dead C, from its view without a write. A then joins the wait list with a fresh
    heartbeat, but B wrote first, so A's write (of the shared state: two nodes changed) is
    lost. What A reads back must still call A dead: a key written before the lost write made
    A a live participant of the round it had already left. A returned alone from a restart
    ('rank 8 of 1') while 126 agents waited for it forever (128 simulated nodes,
    docs/scale.md)."""
    mine, other = _backend(store), _backend(store)
    three = _two_nodes(_ago(10), _ago(0))
    three.participants[C] = 2
    three.last_heartbeats[C] = _ago(10)
    first = other.set_state(pickle.dumps(three))
    assert first is not None
    settings = RendezvousSettings("job", 1, 3, RendezvousTimeout(), KEEP_ALIVE, TRIES)
    holder = _BackendRendezvousStateHolder(mine, settings, cache_duration=0)
    holder.sync()
    assert A not in holder.state.participants  # dead in its own view, nothing written
    moved = pickle.loads(first[0])
    # A write of the shared state after A's read (two nodes at once: not one node's entry).
    moved.wait_list |= {_NodeDesc("10.0.0.3", 9, 0), _NodeDesc("10.0.0.5", 9, 0)}
    assert other.set_state(pickle.dumps(moved), first[1]) is not None
    holder.state.wait_list.add(A)  # torch's _add_to_wait_list: join, keep alive, write
    holder.state.last_heartbeats[A] = datetime.now(timezone.utc)
    holder.mark_dirty()
    assert holder.sync() is False  # lost to that write
    assert A not in holder.state.participants and A not in holder.state.wait_list
    assert _beats(_backend(store))[A] < _ago(9)  # no one sees the lost write's heartbeat
    assert holder.sync() is None and A not in holder.state.participants  # nor on a re-read


@pytest.mark.timeout(60)
def test_a_node_that_found_itself_dead_moves_to_the_wait_list_in_every_view(store: Any) -> None:
    """The same starved A, alone dropped from its own view: its move to the wait list is its
    own, one entry in the log (never lost), and every view then has A waiting, alive, and no
    longer a participant of the round it left: never back in that round."""
    mine, other = _backend(store), _backend(store)
    first = other.set_state(pickle.dumps(_two_nodes(_ago(10), _ago(0))))
    assert first is not None
    settings = RendezvousSettings("job", 1, 2, RendezvousTimeout(), KEEP_ALIVE, TRIES)
    holder = _BackendRendezvousStateHolder(mine, settings, cache_duration=0)
    holder.sync()
    assert A not in holder.state.participants
    holder.state.wait_list.add(A)
    holder.state.last_heartbeats[A] = datetime.now(timezone.utc)
    holder.mark_dirty()
    assert holder.sync() is True
    for view in (holder.state, pickle.loads(_backend(store).get_state()[0])):  # type: ignore[index]
        assert A in view.wait_list and A not in view.participants, view
        assert view.complete and list(view.participants) == [B]
        assert view.last_heartbeats[A] > _ago(5)


def _many(n: int, shared_age: float) -> tuple[_RendezvousState, list[_NodeDesc]]:
    """A completed round of ``n`` nodes whose shared heartbeats are ``shared_age`` s old."""
    nodes = [_NodeDesc(f"10.0.1.{i}", 100 + i, 0) for i in range(n)]
    state = _RendezvousState()
    state.round, state.complete = 1, True
    state.participants = {node: i for i, node in enumerate(nodes)}
    state.last_heartbeats = dict.fromkeys(nodes, _ago(shared_age))
    return state, nodes


def _written(store: Any, n: int, shared_age: float, key_age: float) -> list[_NodeDesc]:
    """A completed round of ``n`` nodes in the store, each node's key signed ``key_age`` s
    ago, and no digest yet (the writer's, made before the keys, forgotten)."""
    state, nodes = _many(n, shared_age)
    assert _backend(store).set_state(pickle.dumps(state)) is not None
    for node in nodes:
        store.set(_hb_key(node), _sealed(_hb_key(node), node, _ago(key_age)))
    _no_digest(store)
    return nodes


def _hb_key(node: _NodeDesc) -> str:
    return f"{KEY}/hb/{node.addr}_{node.pid}_{node.local_id}"


def _key_reads(ops: Ops) -> int:
    """The heartbeat keys one backend read (the multi_gets of ``<key>/hb/...``)."""
    return sum(len(k) for op, k in ops.calls if op == "multi_get" and k[0].startswith(f"{KEY}/hb/"))


@pytest.mark.timeout(30)
def test_one_node_reads_every_key_and_the_others_read_its_digest(store: Any) -> None:
    """Every node read every stale peer's key: N keys per node, N^2 per refresh, at 1.5 us of
    the store's CPU a key (docs/scale.md). Now one node reads them and signs what it verified
    as one value; the others read that, and keep every node alive on it."""
    nodes = _written(store, 8, shared_age=10, key_age=0.5)  # dead but for the keys
    readers = [Ops(store) for _ in range(5)]
    for ops in readers:
        assert _survivors(_backend(ops)) == set(nodes)
    assert [_key_reads(ops) for ops in readers] == [8, 0, 0, 0, 0]
    assert [op for op, k in readers[0].calls if k == CLAIM] == ["compare_set"]
    assert ("set", DIGEST) in readers[0].calls
    assert all((op, CLAIM) not in r.calls for r in readers[1:] for op in ("compare_set", "set"))
    assert len(bytes(store.get(DIGEST))) < 100 * 8 + 300  # O(1) bytes a node


@pytest.mark.timeout(30)
def test_a_node_whose_digest_never_came_is_taken_over_and_nobody_dies_meanwhile(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node won the claim and died before writing the digest (or a stranger wrote the claim
    key): the others read the keys near the limit themselves, and one takes the claim over
    once it is a keep-alive interval old."""
    from meshrun.launch.trust import beat_digest

    clock = [1000.0]
    monkeypatch.setattr(beat_digest.time, "monotonic", lambda: clock[0])
    keep_alive = timedelta(seconds=10)  # dead 30 s after a heartbeat, keys read from 25 s
    nodes = _written(store, 4, shared_age=40, key_age=26)
    store.set(CLAIM, "a-dead-node.1")
    ops = Ops(store)
    mine = _backend(ops, None, keep_alive)
    assert _survivors(mine, keep_alive) == set(nodes)  # read the keys itself: none dead
    assert _key_reads(ops) == 4 and ("set", DIGEST) not in ops.calls
    clock[0] += keep_alive.total_seconds()  # the same claim an interval later: taken over
    ops.calls.clear()
    assert _survivors(mine, keep_alive) == set(nodes)
    assert ("set", DIGEST) in ops.calls
    assert _key_reads(ops) == 4  # every key once: none read again after the refresh
    assert not bytes(store.get(CLAIM)).startswith(b"a-dead-node")


@pytest.mark.timeout(30)
def test_a_deleted_claim_key_does_not_stop_the_refreshes(store: Any) -> None:
    """A claim expects the claim the newest digest names; on a deleted key the store answers
    that expected value itself, which read as another node's claim stopped every refresh."""
    keep_alive = timedelta(seconds=10)  # dead 30 s after a heartbeat, digest read from 20 s
    nodes = _written(store, 4, shared_age=40, key_age=22)
    assert _survivors(_backend(store, None, keep_alive), keep_alive) == set(nodes)
    assert store.check([DIGEST, CLAIM])  # the first reader's refresh
    store.delete_key(CLAIM)
    second = _backend(ops := Ops(store), None, keep_alive)
    second._hb._fresh = timedelta(0)  # the digest just written counts as old: claim the next
    assert _survivors(second, keep_alive) == set(nodes)
    assert ("set", DIGEST) in ops.calls and store.check([CLAIM])


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "forged",
    ["junk", "stranger", "other-launch"],
)
def test_a_forged_digest_is_ignored_once_and_the_node_still_dies(store: Any, forged: str) -> None:
    """A digest that says B is alive, but not signed by this job or this launch: ignored,
    one line; B's own key (old) decides."""
    assert _backend(store).set_state(pickle.dumps(_two_nodes(_ago(0), _ago(10)))) is not None
    store.set(B_KEY, _sealed(B_KEY, B, _ago(4)))
    now_ms = int(datetime.now(timezone.utc).timestamp() * 1e3)
    doc: dict[str, Any] = {"launch": NONCE, "time": _ago(0).isoformat(), "claim": "x.1"}
    doc["beats"] = [[B.addr, B.pid, B.local_id, now_ms]]
    if forged == "other-launch":
        doc["launch"] = "1111222233334444"
    raw = {
        "junk": b"not a digest",
        "stranger": OTHER.seal(DIGEST, json.dumps(doc)),
        "other-launch": SECRET.seal(DIGEST, json.dumps(doc)),
    }[forged]
    store.set(DIGEST, raw)
    said: list[str] = []
    reader = _backend(store, said)
    assert _survivors(reader) == {A}
    _beats(reader)
    lines = [line for line in said if DIGEST in line]
    assert len(lines) == 1 and "heartbeat digest" in lines[0], said
