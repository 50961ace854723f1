"""Who called a live node dead, and why: a diagnostic for ``rdzv_scale.py --trace-dead``.

torch's handler drops a node from the rendezvous when the heartbeat its view holds is older
than the keep-alive interval times its tries (``_sanitize``); a node that writes the state
next writes the drop for everybody. In a simulation only the node stopped on purpose may be
dropped: every other drop is a live node's heartbeat aged in one node's view. After each
sanitize that dropped such a node, this prints (``DEAD:`` lines, at most ``limit`` events)
what the dropping node held of it and what the dropped node had written, read from both
agents' objects in this process and from the store itself.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _BackendRendezvousStateHolder

from meshrun.launch.trust.sealed import unseal_timed


def install(
    agents: list[Any],
    handler_of: Callable[[Any], Any],
    port: int,
    clock: Any,
    nonce: str,
    limit: int = 40,
) -> Callable[[], None]:
    """Trace drops of live nodes among ``agents``; returns the undo. The node stopped on
    purpose is named later with :func:`expect_dead`."""
    by_holder = {id(handler_of(a)._state_holder): a for a in agents}
    by_node = {handler_of(a)._this_node: a for a in agents}
    reader = TCPStore("127.0.0.1", port, is_master=False)
    original = _BackendRendezvousStateHolder._sanitize
    said = [0]

    def traced(holder: Any) -> None:
        before = dict(holder._state.last_heartbeats)  # cheap: a dict copy, no formatting
        snapshot = (holder._state.round, holder._state.complete, len(holder._state.participants))
        original(holder)
        dropped = [n for n in holder._dead_nodes if n not in _EXPECTED]
        if not dropped or said[0] >= limit or id(holder) not in by_holder:
            return
        said[0] += 1
        now = datetime.fromtimestamp(clock.time(), timezone.utc)
        writer = by_holder[id(holder)]
        lines = [
            f"DEAD: {handler_of(writer)._this_node} at {now.isoformat()} dropped "
            f"{len(dropped)} live node(s); its view: round {snapshot[0]} complete {snapshot[1]} "
            f"participants {snapshot[2]}; {_hb_state(holder, clock)}"
        ]
        for node in dropped[:5]:
            lines.append(
                f"DEAD:   {node}: held age {_age(now, before.get(node))} "
                f"{_writer_side(holder, node, now, clock)}; "
                f"{_own_side(by_node.get(node), handler_of, node, now, reader, nonce)}"
            )
        print("\n".join(lines), file=sys.stderr, flush=True)

    _BackendRendezvousStateHolder._sanitize = traced  # type: ignore[method-assign]

    def undo() -> None:
        _BackendRendezvousStateHolder._sanitize = original  # type: ignore[method-assign]

    return undo


_EXPECTED: set[Any] = set()
_READER_LOCK = threading.Lock()


def expect_dead(node: Any) -> None:
    """``node`` is stopped on purpose: its drop is the restart's, not a finding."""
    _EXPECTED.add(node)


def _age(now: datetime, t: datetime | None) -> str:
    return "-" if t is None else f"{(now - t).total_seconds():.2f}s"


def _hb_state(holder: Any, clock: Any) -> str:
    hb = getattr(holder._backend, "_hb", None)
    if hb is None:
        return "no heartbeat keys (c10d)"
    now = datetime.fromtimestamp(clock.time(), timezone.utc)
    return (
        f"keys read {clock.monotonic() - hb._read_at:.2f}s ago, oldest held "
        f"{_age(now, hb._oldest)}, {len(hb._absent)} keys absent"
    )


def _writer_side(holder: Any, node: Any, now: datetime, clock: Any) -> str:
    backend = holder._backend
    hb, log = getattr(backend, "_hb", None), getattr(backend, "_log", None)
    if hb is None:
        return ""
    absent = hb.key(node) in hb._absent
    entry = log.newest.get(node) if log is not None else None
    where = entry and (entry.slot, entry.round, entry.place, _age(now, entry.time))
    return f"seen {_age(now, hb._seen.get(node))} absent {absent} entry {where}"


def _own_side(
    agent: Any, handler_of: Callable[[Any], Any], node: Any, now: datetime, reader: Any, nonce: str
) -> str:
    if agent is None:
        return "not an agent of this run"
    handler = handler_of(agent)
    backend = handler._state_holder._backend
    hb = getattr(backend, "_hb", None)
    state = handler._state_holder.state
    timer = handler._keep_alive_timer
    thread = getattr(timer, "_thread", None)
    alive = thread is not None and thread.is_alive() and not timer._ctx.stop_event.is_set()
    own = (
        f"its own: round {state.round} complete {state.complete} participant "
        f"{node in state.participants} own hb {_age(now, state.last_heartbeats.get(node))} "
        f"timer alive {alive}"
    )
    if hb is None:
        return own
    key = hb.key(node)
    stored = "missing"
    with _READER_LOCK:  # one client, called from every agent's thread
        raw = bytes(reader.get(key)) if reader.check([key]) else None
    if raw is not None:
        doc, why = unseal_timed(backend._secret, key, raw, nonce)
        stored = _age(now, doc["time"]) if doc else why
    return f"{own} key written {_age(now, hb._keyed.get(node))} key in store {stored}"


def say_charges(clock: Any, phase: str) -> None:
    """The event clock's largest CPU charges and the collector's passes since the last call
    (``CHARGE:`` lines): a thread charged seconds waits that much longer than its host would."""
    if not hasattr(clock, "take_charges"):  # a dilated clock charges nothing
        return
    charges, gc_s, longest = clock.take_charges()
    gc_note = f"; garbage collection {gc_s:.1f} s CPU, longest pass {longest:.2f} s"
    if not charges:
        print(f"CHARGE: {phase}: none over 0.5 s{gc_note}", file=sys.stderr, flush=True)
        return
    top = ", ".join(f"{s:.2f} s ({name} at {t:.1f})" for s, name, t in sorted(charges)[::-1][:5])
    print(
        f"CHARGE: {phase}: {len(charges)} charges over 0.5 s; largest {top}{gc_note}",
        file=sys.stderr,
        flush=True,
    )
