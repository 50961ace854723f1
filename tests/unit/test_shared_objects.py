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
