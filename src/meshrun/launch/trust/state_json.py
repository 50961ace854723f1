"""torch's rendezvous state as plain JSON values and back, for the signed backend
(``rendezvous.py``): nodes as ``[addr, pid, local id]``, every list sorted, so two nodes
sealing the same state write the same bytes."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

# A backend's one object per node, by its fields: the states it decodes, its log entries and
# heartbeat digests name the same objects. torch's node type hashes and compares in Python;
# a lookup of the very object a map holds skips the comparison, and a node is made once, not
# once per value read (each of N agents reads every node's entries and times).
Nodes = dict[tuple[str, int, int], _NodeDesc]


def node_of(nodes: Nodes, addr: str, pid: int, local_id: int) -> _NodeDesc:
    """The object for this node in ``nodes``, made and kept on first sight."""
    key = (addr, pid, local_id)
    held = nodes.get(key)
    if held is None:
        held = nodes[key] = _NodeDesc(addr, pid, local_id)
    return held


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


def state_from_json(doc: dict[str, Any], nodes: Nodes | None = None) -> _RendezvousState:
    """The state of :func:`state_to_json`'s document; its nodes from ``nodes`` (kept there)."""
    state = _RendezvousState()
    state.round = int(doc["round"])
    state.complete = bool(doc["complete"])
    state.deadline = datetime.fromisoformat(doc["deadline"]) if doc["deadline"] else None
    state.closed = bool(doc["closed"])
    # One object per node, shared by the fields: the pickle handed to torch's handler then
    # holds each node once (it halved the pickle's time at 1,024 nodes).
    nodes = {} if nodes is None else nodes
    state.participants = {_desc(p[:3], nodes): int(p[3]) for p in doc["participants"]}
    state.wait_list = {_desc(n, nodes) for n in doc["wait_list"]}
    state.redundancy_list = {_desc(n, nodes) for n in doc["redundancy_list"]}
    state.last_heartbeats = {
        _desc(h[:3], nodes): datetime.fromisoformat(h[3]) for h in doc["last_heartbeats"]
    }
    return state


def _node(node: _NodeDesc) -> list[Any]:
    return [node.addr, node.pid, node.local_id]


def _desc(item: list[Any], nodes: Nodes) -> _NodeDesc:
    addr, pid, local_id = item
    if not isinstance(addr, str):
        raise TypeError(f"a node address must be a string, got {addr!r}")
    return node_of(nodes, addr, int(pid), int(local_id))
