"""benchmarks/shared_objects.py: thousands of simulated agents in one process share the nodes
and times they decode alike (what lets 4,096 of them fit this machine's memory), and nothing
else changes: the states decoded are equal, and leaving the block puts every patch back."""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

import scripts
from meshrun.launch.trust import state_json

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _module() -> ModuleType:
    # Registered: pickles name its functions by this module's name.
    return scripts.load(BENCH / "shared_objects.py", "_shared_objects_under_test", register=True)


def _state(n: int) -> _RendezvousState:
    state = _RendezvousState()
    t0 = datetime(2026, 12, 7, tzinfo=timezone.utc)
    for i in range(n):
        node = _NodeDesc(f"10.0.0.{i}", 100 + i, 0)
        state.participants[node] = i
        state.last_heartbeats[node] = t0 + timedelta(microseconds=i)
    return state


def test_agents_decoding_the_same_state_share_its_nodes_and_times() -> None:
    shared = _module()
    state = _state(5)
    with shared.shared():
        bits = pickle.dumps(state)
        a, b = pickle.loads(bits), pickle.loads(bits)  # two agents' handlers
        doc = state_json.state_to_json(state)
        table: dict[tuple[str, int, int], _NodeDesc] = {}  # a fourth agent's own table
        c = state_json.state_from_json(doc, table)  # a third agent's backend, from the JSON
        assert not table  # the process's table serves every agent
    for got in (a, b, c):
        assert got.participants == state.participants
        assert got.last_heartbeats == state.last_heartbeats
    for node in a.participants:
        other = next(n for n in b.participants if n == node)
        from_json = next(n for n in c.participants if n == node)
        assert other is node and from_json is node
        assert b.last_heartbeats[node] is a.last_heartbeats[node]
        assert c.last_heartbeats[node] is a.last_heartbeats[node]


def test_leaving_puts_every_patch_back() -> None:
    shared = _module()
    with shared.shared():
        pass
    assert state_json._NodeDesc is _NodeDesc
    assert state_json.node_of.__module__ == state_json.__name__
    assert b"shared_objects" not in pickle.dumps(_state(2))
    a, b = pickle.loads(pickle.dumps(_state(2))), pickle.loads(pickle.dumps(_state(2)))
    assert all(x is not y for x, y in zip(a.participants, b.participants, strict=True))


def test_c10d_states_share_their_nodes_and_times_yet_pickle_to_torchs_own_bytes() -> None:
    """c10d's pickles go to the store and are measured: shared_loads swaps what torch's
    handler unpickled, and each distinct object of a state stays distinct. A handler's own
    node beside a loaded copy of it, and two heartbeats on one instant, pickle in full twice;
    made one object, they would pickle as a reference (fewer bytes than a host sends)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    shared = _module()
    state = _state(4)
    mine = _NodeDesc("10.0.0.1", 101, 0)  # equal to a participant, another object
    state.wait_list.add(mine)
    first = next(iter(state.participants))
    same = state.last_heartbeats[first]
    state.last_heartbeats[_NodeDesc("10.0.0.9", 109, 0)] = datetime.fromtimestamp(
        same.timestamp(), timezone.utc
    )  # the same instant, another object
    bits = pickle.dumps(state)
    loaded = pickle.loads(bits)
    took: list[int] = []

    class Uncharged:  # the event clock's uncharged(): here, only that it is entered
        def __enter__(self) -> None:
            took.append(1)

        def __exit__(self, *exc: object) -> None:
            pass

    with shared.shared_loads(Uncharged):
        a = dynamic_rendezvous.pickle.loads(bits)  # two agents' handlers
        b = dynamic_rendezvous.pickle.loads(bits)
        assert dynamic_rendezvous.pickle.dumps(a) == bits == pickle.dumps(loaded)
    assert took == [1, 1]
    assert dynamic_rendezvous.pickle is pickle
    assert a.participants == state.participants and a.wait_list == state.wait_list
    assert a.last_heartbeats == state.last_heartbeats
    for x, y in zip(a.participants, b.participants, strict=True):
        assert x is y
        assert a.last_heartbeats[x] is b.last_heartbeats[y]
    (waiting,) = a.wait_list
    copy = next(n for n in a.participants if n == waiting)
    assert waiting is not copy  # two objects in the state, two after the swap
    t0, t9 = a.last_heartbeats[first], a.last_heartbeats[_NodeDesc("10.0.0.9", 109, 0)]
    assert t0 == t9 and t0 is not t9
