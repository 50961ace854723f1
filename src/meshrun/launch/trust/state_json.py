"""torch's rendezvous state as plain JSON values and back, for the signed backend
(``rendezvous.py``): nodes as ``[addr, pid, local id]``, every list sorted, so two nodes
sealing the same state write the same bytes."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState


def state_to_json(state: _RendezvousState) -> dict[str, Any]:
    """The fields of torch's rendezvous state as JSON values (nodes as [addr, pid, id]),
    sorted by node: sorting plain lists, not the dataclasses, costs a third as much."""
    return {
        "round": state.round,
        "complete": state.complete,
        "deadline": state.deadline.isoformat() if state.deadline else None,
        "closed": state.closed,
        "participants": sorted([*_node(n), rank] for n, rank in state.participants.items()),
        "wait_list": sorted(_node(n) for n in state.wait_list),
        "redundancy_list": sorted(_node(n) for n in state.redundancy_list),
        "last_heartbeats": sorted(
            [*_node(n), t.isoformat()] for n, t in state.last_heartbeats.items()
        ),
    }


def state_from_json(doc: dict[str, Any]) -> _RendezvousState:
    state = _RendezvousState()
    state.round = int(doc["round"])
    state.complete = bool(doc["complete"])
    state.deadline = datetime.fromisoformat(doc["deadline"]) if doc["deadline"] else None
    state.closed = bool(doc["closed"])
    # One object per node, shared by the fields: the pickle handed to torch's handler then
    # holds each node once (it halved the pickle's time at 1,024 nodes).
    nodes: dict[tuple[Any, ...], _NodeDesc] = {}
    state.participants = {_desc(p[:3], nodes): int(p[3]) for p in doc["participants"]}
    state.wait_list = {_desc(n, nodes) for n in doc["wait_list"]}
    state.redundancy_list = {_desc(n, nodes) for n in doc["redundancy_list"]}
    state.last_heartbeats = {
        _desc(h[:3], nodes): datetime.fromisoformat(h[3]) for h in doc["last_heartbeats"]
    }
    return state


def _node(node: _NodeDesc) -> list[Any]:
    return [node.addr, node.pid, node.local_id]


def _desc(item: list[Any], nodes: dict[tuple[Any, ...], _NodeDesc]) -> _NodeDesc:
    key = tuple(item)
    if key in nodes:
        return nodes[key]
    addr, pid, local_id = item
    if not isinstance(addr, str):
        raise TypeError(f"a node address must be a string, got {addr!r}")
    nodes[key] = desc = _NodeDesc(addr, int(pid), int(local_id))
    return desc
