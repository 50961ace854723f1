"""An event clock for simulations that run many agents in one process (``rdzv_scale.py``).

The dilated clock (``virtual_clock.py``) gives the agents K real seconds per virtual second;
on 2 cores, 1,024 agents starved even at K=32, and whether a run starved depended on what
else the machine ran. This clock does not run at a rate at all: virtual time stands still
while any simulated thread is doing something (its Python, a store operation), and moves
only when every simulated thread waits on it, straight to the earliest wake-up. Each thread's
own CPU time is charged to it (its next wait begins that much later), as if each ran on a
host of its own at this machine's speed: a round's virtual duration is the protocol's own
waits (join spread, 1 s polls, keep-alive, heartbeat expiry, the last call) plus each node's
own work, whatever else the machine runs, and a run cannot starve. The store's work and the
network's round trips are not charged: the store's CPU is measured apart, in real seconds.

Simulated threads are all of the process's threads but those alive when the clock was made
(the caller's, a test runner's) and the clock's own: a thread that blocks on anything but
this clock (a socket, a lock, a join) holds time still until it is done. Waits on the clock:
``sleep`` and ``wait_event`` (an ``Event`` made by ``event()``, whose ``set`` wakes it). A
thread that waits on the clock while holding a lock that another simulated thread blocks on
would stop time for good: torch's handler and meshrun's backend take their locks only around
store calls and their own Python, never around a wait (and this clock adds none inside them).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import sys
import threading
import time as _time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed import Store

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path in tests
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import virtual_clock

CHARGE_NOTED_S = 0.5  # a charge larger than this is kept in EventClock.charges


class _Waiter:
    __slots__ = ("done", "go", "wake")

    def __init__(self, wake: float) -> None:
        self.wake, self.done, self.go = wake, False, threading.Event()


class EventClock(virtual_clock.AnchoredClock):
    """Virtual time that advances only when every simulated thread waits on it (see the
    module); ``sleep`` waits on it.

    ``poll_s``: how often (real seconds) a thread of the clock's own looks whether every
    simulated thread waits; needed where the last thread to move ended instead of waiting.
    ``steps`` counts the moves of time."""

    def __init__(self, poll_s: float = 0.002) -> None:
        super().__init__(_time.monotonic())
        self._now = 0.0
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._cpu = threading.local()  # each thread's CPU time at its last wait's end
        self._waiting = 0
        self.steps = 0
        # The largest CPU charges (seconds, thread name, virtual time): a diagnostic. One
        # thread's charge of seconds (time it spent, or the GIL's waits counted as its CPU)
        # delays its next wake-up as much: a keep-alive late by 15 s is a node called dead.
        self.charges: list[tuple[float, str, float]] = []
        # The cyclic garbage collector's passes, in CPU seconds: a pass walks every agent's
        # objects (a pause of seconds with 1,024 agents in one process, where a host's agent
        # has a heap of its own of a few MB), so it is not charged to the thread that
        # happened to trigger it (``gc_pass``).
        self.gc_s, self.gc_max_s = 0.0, 0.0
        self._gc_taken = 0.0  # gc_s at the last take_charges()
        # The simulation's own bookkeeping run inside an agent's thread (``uncharged``).
        self.uncharged_s = 0.0
        self._uncharged_lock = threading.Lock()
        # ClockedStore's waits for a key to be set: key -> the event its setter sets.
        self._keys_lock = threading.Lock()
        self._keyed: dict[str, threading.Event] = {}
        self.missed_sets = 0  # keys a ClockedStore found set without a wake-up (see there)
        self._stop = threading.Event()
        # Not simulated: the threads alive now, and the clock's own thread started below.
        self._outside = threading.active_count() + 1
        self._thread = threading.Thread(
            target=self._watch, args=(poll_s,), name="event-clock", daemon=True
        )
        self._thread.start()

    def elapsed(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        self._wait(seconds, None)

    def event(self) -> threading.Event:
        """An ``Event`` whose ``set`` wakes a thread in ``wait_event`` on it at once."""
        return _ClockEvent(self)

    def wait_event(self, event: threading.Event, timeout: float) -> bool:
        """``event.wait(timeout)`` with the timeout on this clock; ``event`` from ``event()``."""
        assert isinstance(event, _ClockEvent), "an event made by EventClock.event()"
        return self._wait(timeout, event)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _wait(self, seconds: float, event: _ClockEvent | None) -> bool:
        # The CPU this thread spent since its last wait is charged to it, as on a host of its
        # own: its wait begins that much later. Without it a node's work would take no time,
        # and torch's handler, which serves a state synced no more than 1 s ago (>=) from its
        # cache, would find its 1 s poll exactly 1 s after the last and read nothing new.
        cpu = _time.thread_time()
        spent = cpu - getattr(self._cpu, "mark", 0.0)
        with self._lock:
            if spent > CHARGE_NOTED_S:
                self.charges.append((spent, threading.current_thread().name, self._now))
            if event is not None and event.is_set():
                self._cpu.mark = cpu
                return True
            waiter = _Waiter(self._now + spent + max(0.0, seconds))
            heapq.heappush(self._heap, (waiter.wake, next(self._seq), waiter))
            self._waiting += 1
            if event is not None:
                event.waiters.append(waiter)
            self._advance_if_all_wait()
        waiter.go.wait()
        self._cpu.mark = _time.thread_time()
        return event is not None and event.is_set()

    def event_for(self, key: str) -> threading.Event:
        """The event ``key_set(key)`` sets (``ClockedStore``): one per key until then."""
        with self._keys_lock:
            event = self._keyed.get(key)
            if event is None:
                event = self._keyed[key] = self.event()
            return event

    def key_set(self, key: str) -> None:
        with self._keys_lock:
            event = self._keyed.pop(key, None)
        if event is not None:
            event.set()  # takes the clock's lock: not under _keys_lock

    def take_charges(self) -> tuple[list[tuple[float, str, float]], float, float]:
        """Since the last call: the charges over ``CHARGE_NOTED_S``, the collector's CPU and
        its longest pass; then forgets them (``gc_s`` keeps the total)."""
        with self._lock:
            charges, self.charges = self.charges, []
        took, self._gc_taken = self.gc_s - self._gc_taken, self.gc_s
        longest, self.gc_max_s = self.gc_max_s, 0.0
        return charges, took, longest

    def gc_pass(self, phase: str, info: dict[str, Any]) -> None:
        """A ``gc.callbacks`` entry: the pass's CPU moves this thread's charge mark."""
        now = _time.thread_time()
        if phase == "start":
            self._cpu.gc_from = now
            return
        took = now - getattr(self._cpu, "gc_from", now)
        self._cpu.mark = getattr(self._cpu, "mark", 0.0) + took
        self._cpu.gc_in = getattr(self._cpu, "gc_in", 0.0) + took  # for ``uncharged``
        self.gc_s += took
        self.gc_max_s = max(self.gc_max_s, took)

    @contextmanager
    def uncharged(self) -> Iterator[None]:
        """The CPU of the block is the simulation's, not the agent's (``shared_objects``
        swapping what an agent decoded for the process's one copy): it moves this thread's
        charge mark, as a collector's pass does, and adds to ``uncharged_s``."""
        began, gc_before = _time.thread_time(), getattr(self._cpu, "gc_in", 0.0)
        try:
            yield
        finally:
            # A collector's pass inside the block has moved the mark already: moved twice,
            # the mark would run ahead of the thread's CPU and its next wait begin early.
            gc_inside = getattr(self._cpu, "gc_in", 0.0) - gc_before
            took = _time.thread_time() - began - gc_inside
            self._cpu.mark = getattr(self._cpu, "mark", 0.0) + took
            with self._uncharged_lock:
                self.uncharged_s += took

    def _wake(self, waiter: _Waiter) -> None:
        """Under the lock: one waiter woken (its time came, or its event was set)."""
        if not waiter.done:
            waiter.done = True
            self._waiting -= 1
            waiter.go.set()

    def _advance_if_all_wait(self) -> None:
        """Under the lock: if every simulated thread waits on the clock, move it to the
        earliest wake-up and wake every waiter due then."""
        if self._waiting < threading.active_count() - self._outside:
            return
        while self._heap and self._heap[0][2].done:  # woken by their events already
            heapq.heappop(self._heap)
        if not self._heap:
            return
        self._now = max(self._now, self._heap[0][0])
        self.steps += 1
        while self._heap and self._heap[0][0] <= self._now:
            self._wake(heapq.heappop(self._heap)[2])

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            with self._lock:
                self._advance_if_all_wait()


class ClockedStore(Store):
    """A store whose ``get`` of a key not yet set waits on the clock: torch's handler and
    meshrun's port wrapper read the workers' address with a blocking ``get``, for rank 0 to
    set it, and a thread blocked in a socket holds time still (rank 0 may be waiting for time
    to move before it gets there). A ``Store`` (torch's handler hands it to C++); the calls
    the handlers make go to ``store`` as they are.

    The wait ends when another ``ClockedStore`` on the same clock sets the key (every agent's
    store wraps one of the same run's keys), as a real store's ``get`` is answered: one
    request, held by the server. Until 2026-12-07 the wait was a ``check`` every 10 ms of
    virtual time: c10d's agents made 9.4 of them each in a 1,024-node first round (meshrun's
    0.3), store operations a real agent does not make, charged to the store's CPU. ``poll_s``
    is the fallback for a key set some other way; a key found set by it is counted
    (``EventClock.missed_sets``) and said by the benchmark."""

    def __init__(self, store: Store, clock: EventClock, poll_s: float = 1.0) -> None:
        super().__init__()
        self._store, self._clock, self._poll_s = store, clock, poll_s

    def get(self, key: str) -> bytes:
        event: threading.Event | None = None
        timed_out = False
        while not self._store.check([key]):
            if event is None or event.is_set():
                # Checked once more after the event is made: a set before it woke nobody.
                event = self._clock.event_for(key)
                continue
            timed_out = not self._clock.wait_event(event, self._poll_s)
        if timed_out:
            self._clock.missed_sets += 1
        return self._store.get(key)

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(key, value)
        # A TCPStore client's set is not answered: a waiter woken now could check before the
        # server has it (a wait then ran to the fallback poll, 1 to 5 times a run). A request
        # answered on this connection comes after it.
        self._store.check([key])
        self._clock.key_set(key)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._store.compare_set(key, expected, desired)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._store.multi_get(keys)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(key)


class _ClockEvent(threading.Event):
    def __init__(self, clock: EventClock) -> None:
        super().__init__()
        self.clock, self.waiters = clock, list[_Waiter]()

    def set(self) -> None:
        super().set()
        with self.clock._lock:
            for waiter in self.waiters:
                self.clock._wake(waiter)
            self.waiters.clear()


def _patch_timer(clock: EventClock, undo: list[Callable[[], None]]) -> None:
    """torch's keep-alive thread waits ``stop_event.wait(interval)``: on the clock instead,
    with a stop event whose ``set`` (the handler stopping its heartbeats) wakes it."""
    from torch.distributed.elastic.rendezvous import utils

    timer = utils._PeriodicTimer
    init, run = timer.__init__, timer.__dict__["_run"]

    def clocked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._ctx.stop_event = clock.event()

    def clocked_run(ctx: Any) -> None:
        while not clock.wait_event(ctx.stop_event, ctx.interval):
            ctx.function(*ctx.args, **ctx.kwargs)

    timer.__init__ = clocked_init  # type: ignore[method-assign]
    timer._run = staticmethod(clocked_run)  # type: ignore[assignment]
    undo.append(lambda: setattr(timer, "__init__", init))
    undo.append(lambda: setattr(timer, "_run", run))


@contextmanager
def events(poll_s: float = 0.002) -> Iterator[EventClock]:
    """Within the block the rendezvous code (``virtual_clock.PREFIXES``) runs on an event
    clock, yielded for the caller's own timing. As for ``virtual_clock.dilate``, handlers made
    inside must be done with (heartbeats stopped) before the block ends."""
    clock = EventClock(poll_s)
    undo: list[Callable[[], None]] = []
    try:
        virtual_clock.patch_modules(clock, undo)
        _patch_timer(clock, undo)
        gc.callbacks.append(clock.gc_pass)
        undo.append(lambda: gc.callbacks.remove(clock.gc_pass))
        yield clock
    finally:
        for put_back in reversed(undo):
            put_back()
        clock.close()
