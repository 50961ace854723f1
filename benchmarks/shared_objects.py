"""One object per process for what every simulated agent decodes alike (``rdzv_scale.py``).

On its own host an agent holds a few copies of the rendezvous state: O(N) objects, a few MB
at 4,096 nodes. N agents in one process hold N times that: O(N^2), 23 GB at 4,096 nodes,
this machine's memory (docs/scale.md). Most of it is the same immutable values decoded again
by every agent: each node's ``_NodeDesc`` and its address, each heartbeat's ``datetime``, each
log entry. Within :func:`shared` those are made once per process: the decoding itself (JSON,
HMAC, pickle) still runs in every agent, as on its host, and is charged to it; only the
result is swapped for the equal object made first, and the agent's copy is garbage at once.
What an agent holds is then its own dicts, lists and bytes, which a real host holds too.

Patched, and put back on leaving:
- ``_NodeDesc`` pickles as a call of :func:`node` (torch's handler unpickles the state at
  every change; meshrun's backend unpickles the handler's), and meshrun's JSON decoding
  (``state_json``, ``joinlog``) builds nodes with it; a backend's own table of nodes
  (``state_json.node_of``) is this process's one (a table per agent held N keys: 4,096 x
  4,096 of them);
- ``datetime`` pickles as a call of :func:`moment`, and ``fromisoformat`` in those modules
  and in ``sealed`` (heartbeats, log entries) answers the first equal time parsed;
- a verified log entry (``JoinLog._entry``, from a slot or a chunk) is the first equal entry.
On an older checkout, without those modules, only the pickles are patched: safe, as meshrun's
pickles never leave the process.

torch's c10d backend's pickles go to the store and their bytes are measured, so
:func:`shared_loads` patches no pickle: after torch's handler has unpickled a state (charged
to its agent), the state's nodes and times are swapped for the process's ones, uncharged,
each distinct object of the state for a distinct one (a pickle's bytes depend on which
equal values are one object).
"""

from __future__ import annotations

import copyreg
import pickle
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime as _datetime
from typing import Any

from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

try:
    from meshrun.launch.trust import joinlog, sealed, state_json
except ImportError:  # an older checkout (a "before" row, rdzv_before.py): only the pickles
    sealed = joinlog = state_json = None  # type: ignore[assignment]
try:
    from meshrun.launch.trust import beat_digest
except ImportError:  # a checkout before the heartbeat digest
    beat_digest = None  # type: ignore[assignment]

_NODES: dict[tuple[str, int, int], _NodeDesc] = {}
_MOMENTS: dict[Any, _datetime] = {}
_ENTRIES: dict[Any, Any] = {}
# shared_loads: (value, n) -> the process's n-th object of that value (_share_state).
_COPIES: dict[tuple[Any, int], Any] = {}


def node(addr: str, pid: int, local_id: int) -> _NodeDesc:
    """The process's one ``_NodeDesc`` equal to these fields."""
    key = (addr, pid, local_id)
    held = _NODES.get(key)
    if held is None:
        held = _NODES[key] = _NodeDesc(addr, pid, local_id)  # torch's class: never swapped
    return held


def moment(state: bytes, tz: Any = None) -> _datetime:
    """The process's one ``datetime`` of this pickled state (what ``datetime.__reduce__``
    gives)."""
    key = (state, tz)
    held = _MOMENTS.get(key)
    if held is None:
        held = _MOMENTS[key] = _datetime(state, tz)  # type: ignore[call-overload]
    return held


def _moment_key(t: _datetime) -> tuple[Any, Any]:
    args = _datetime.__reduce__(t)[1]
    return args[0], args[1] if len(args) > 1 else None


def _node_of(nodes: Any, addr: str, pid: int, local_id: int) -> _NodeDesc:
    """``state_json.node_of`` with this process's table for every agent's."""
    return node(addr, pid, local_id)


def _reduce_node(desc: _NodeDesc) -> tuple[Any, ...]:
    return node, (desc.addr, desc.pid, desc.local_id)


def _reduce_moment(t: _datetime) -> tuple[Any, ...]:
    return moment, _datetime.__reduce__(t)[1]


def _parsing(cls: type[_datetime]) -> type[_datetime]:
    """``cls`` (the module's ``datetime``, the clock's subclass) whose ``fromisoformat``
    answers the first equal time parsed."""
    seen: dict[str, _datetime] = {}

    class Parsed(cls):  # type: ignore[valid-type, misc]
        @classmethod
        def fromisoformat(cls_, text: str) -> _datetime:  # type: ignore[override]
            held = seen.get(text)
            if held is None:
                # A plain datetime, as the clock's now() gives: it pickles through moment().
                parsed = _datetime.fromisoformat(text)
                held = seen[text] = _MOMENTS.setdefault(_moment_key(parsed), parsed)
            return held

    return Parsed


@contextmanager
def shared() -> Iterator[None]:
    """Within the block, the patches of the module docstring. Enter it inside the clock's
    block (it wraps the clock's ``datetime``)."""
    undo: list[Callable[[], None]] = []
    try:
        _NodeDesc.__reduce__ = _reduce_node  # type: ignore[assignment, method-assign]
        undo.append(lambda: delattr(_NodeDesc, "__reduce__"))
        clock_datetime = _datetime if state_json is None else state_json.datetime
        for cls in {_datetime, clock_datetime}:  # the clock's datetime pickles as plain
            copyreg.dispatch_table[cls] = _reduce_moment
            undo.append(lambda cls=cls: copyreg.dispatch_table.pop(cls, None))
        if state_json is not None:
            _share_decoded(undo)
        yield
    finally:
        for put_back in reversed(undo):
            put_back()
        _NODES.clear(), _MOMENTS.clear(), _ENTRIES.clear()


@contextmanager
def shared_loads(uncharged: Callable[[], Any]) -> Iterator[None]:
    """Within the block, every state torch's handler unpickles holds the process's nodes and
    times (:func:`_share_state`); ``uncharged()``: a context whose CPU is not the agent's
    (the event clock's ``uncharged``)."""

    def loads(bits: bytes) -> Any:
        state = pickle.loads(bits)  # the agent's own work, as on its host
        if isinstance(state, _RendezvousState):
            with uncharged():
                _share_state(state)
        return state

    shim = types.ModuleType("pickle")
    shim.__dict__.update(pickle.__dict__)
    shim.loads = loads  # type: ignore[attr-defined]
    real = dynamic_rendezvous.pickle
    dynamic_rendezvous.pickle = shim
    try:
        yield
    finally:
        dynamic_rendezvous.pickle = real
        _COPIES.clear()


def _share_state(state: _RendezvousState) -> None:
    """``state``'s nodes and heartbeat times swapped for the process's equal ones, the
    state's own identities kept: equal values that were two objects in it stay two (a
    handler adds its own node object beside a loaded copy; many nodes' heartbeats fall on
    one virtual instant), as a pickle writes each object out once and its repeats as
    references: made one, every state pickled after would be smaller than torch's on a
    host."""
    mine: dict[int, Any] = {}  # id of a loaded object -> its shared one
    copies: dict[Any, int] = {}  # distinct objects seen of equal value

    def one(obj: Any, value: Any) -> Any:
        held = mine.get(id(obj))  # the state holds every loaded object: ids stay unique
        if held is None:
            nth = copies.get(value, 0)
            copies[value] = nth + 1
            held = mine[id(obj)] = _COPIES.setdefault((value, nth), obj)
        return held

    def desc(d: _NodeDesc) -> _NodeDesc:
        return one(d, (d.addr, d.pid, d.local_id))  # type: ignore[no-any-return]

    state.participants = {desc(d): rank for d, rank in state.participants.items()}
    state.wait_list = {desc(d) for d in state.wait_list}
    state.redundancy_list = {desc(d) for d in state.redundancy_list}
    state.last_heartbeats = {
        desc(d): one(t, (t, t.tzinfo)) for d, t in state.last_heartbeats.items()
    }


def _share_decoded(undo: list[Callable[[], None]]) -> None:
    """meshrun's JSON decoding builds nodes and times with the shared ones; a verified log
    entry is the first equal one."""
    for module in (state_json, joinlog):
        _swap(module, "_NodeDesc", node, undo)
    for module in (state_json, joinlog, beat_digest):
        if module is not None and hasattr(module, "node_of"):
            _swap(module, "node_of", _node_of, undo)
    for module in (state_json, sealed, joinlog):
        _swap(module, "datetime", _parsing(module.datetime), undo)
    make = getattr(joinlog.JoinLog, "_entry", None)
    if make is None:  # a checkout before chunks of entries: its _verify makes them
        _share_verified(undo)
        return

    def shared_entry(self: Any, *fields: Any) -> Any:
        entry = make(self, *fields)
        return _ENTRIES.setdefault(entry, entry)

    joinlog.JoinLog._entry = shared_entry  # type: ignore[method-assign]
    undo.append(lambda: setattr(joinlog.JoinLog, "_entry", make))


def _share_verified(undo: list[Callable[[], None]]) -> None:
    verify = joinlog.JoinLog._verify

    def shared_verify(self: Any, slot: int, raw: bytes, quiet: bool = False) -> Any:
        entry = verify(self, slot, raw, quiet)
        return entry if entry is None else _ENTRIES.setdefault(entry, entry)

    joinlog.JoinLog._verify = shared_verify  # type: ignore[method-assign]
    undo.append(lambda: setattr(joinlog.JoinLog, "_verify", verify))


def _swap(module: Any, name: str, value: Any, undo: list[Callable[[], None]]) -> None:
    old = getattr(module, name)
    setattr(module, name, value)
    undo.append(lambda: setattr(module, name, old))
