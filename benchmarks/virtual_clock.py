"""A dilated clock for simulations that run many agents in one process (``rdzv_scale.py``).

On a machine with few cores, N agents' Python shares one GIL: past ~128 agents they cannot
keep up with the protocol's real-time waits (a keep-alive every 5 s, heartbeats missed after
15 s), so live nodes are declared dead for want of CPU, not of a network. Dilating by K runs
every clock the protocol reads K times slower than the real one and every sleep K times
longer: each virtual second then gives the agents K real seconds of CPU, as a machine with K
times the cores would, while the protocol's waits keep their virtual length.

``dilate(k)`` patches, for every imported module under the prefixes in ``PREFIXES``, the
module-global names ``time`` (by a ``VirtualTime``) and ``datetime`` (by a subclass whose
``now``/``utcnow`` are virtual), and functions imported by name from ``time``; and torch's
``_PeriodicTimer`` (the keep-alive thread waits on an Event, not on ``time.sleep``). It scans
``sys.modules`` rather than naming modules, so a new module of meshrun's launch code that reads
the clock is dilated too. Leaving the ``with`` block puts every original object back.
"""

from __future__ import annotations

import sys
import time as _time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime as _datetime
from datetime import timezone, tzinfo
from importlib import import_module
from types import ModuleType
from typing import Any

# The modules whose clocks are dilated: torch's elastic rendezvous (handler, c10d backend,
# utils' _delay and _PeriodicTimer) and meshrun's launch code (signed backend, heartbeat keys,
# the port-holding wrapper, and whatever joins them).
PREFIXES = ("torch.distributed.elastic.rendezvous", "meshrun.launch")
# Imported before the scan so that their clocks are dilated even if the caller has not yet.
PRELOAD = (
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "meshrun.launch.trust.rendezvous",
    "meshrun.launch.trust.heartbeats",
    "meshrun.launch.agent.store_port",
)


class AnchoredClock:
    """Stands for the ``time`` module: ``monotonic``, ``time`` and ``perf_counter`` are the real
    clocks' values at ``t0`` (the monotonic one given) plus ``elapsed()`` virtual seconds, so
    they stay continuous with the real clocks read before and advance together; anything but
    ``sleep`` is the real module's. A subclass says how virtual time passes."""

    def __init__(self, t0: float) -> None:
        self._t0 = t0
        self._wall0, self._perf0 = _time.time(), _time.perf_counter()

    def elapsed(self) -> float:
        """Virtual seconds since this clock was made."""
        raise NotImplementedError

    def sleep(self, seconds: float) -> None:
        raise NotImplementedError

    def monotonic(self) -> float:
        return self._t0 + self.elapsed()

    def time(self) -> float:
        return self._wall0 + self.elapsed()

    def perf_counter(self) -> float:
        return self._perf0 + self.elapsed()

    def __getattr__(self, name: str) -> Any:  # struct_time, strftime, ...: the real ones
        return getattr(_time, name)


class VirtualTime(AnchoredClock):
    """A clock whose time advances at 1/k of the real rate from the moment it was made, and
    whose ``sleep`` lasts k times longer.

    ``real`` and ``real_sleep`` are the real clock and sleep; a test passes fake ones so that
    the rate is checked without timing windows."""

    def __init__(
        self,
        k: float,
        real: Callable[[], float] = _time.monotonic,
        real_sleep: Callable[[float], None] = _time.sleep,
    ) -> None:
        if k <= 0:
            raise ValueError(f"dilation must be positive, got {k}")
        self.k, self._real, self._real_sleep = k, real, real_sleep
        super().__init__(real())

    def elapsed(self) -> float:
        return (self._real() - self._t0) / self.k

    def sleep(self, seconds: float) -> None:
        self._real_sleep(seconds * self.k)


class _AnyDatetime(type):
    """``isinstance(t, datetime)`` in a patched module stays true of the plain datetimes that
    ``now`` returns and that states decoded elsewhere hold."""

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _datetime)


def virtual_datetime(clock: AnchoredClock) -> type[_datetime]:
    """A ``datetime`` subclass whose ``now`` and ``utcnow`` read ``clock``. They return plain
    ``datetime`` objects, and pickling an instance made otherwise (``fromisoformat``) gives a
    plain one too: states holding these times are pickled for, and by, torch's handler, and
    must not name a class of this module."""

    class VirtualDatetime(_datetime, metaclass=_AnyDatetime):
        @classmethod
        def now(cls, tz: tzinfo | None = None) -> _datetime:  # type: ignore[override]
            return _datetime.fromtimestamp(clock.time(), tz)

        @classmethod
        def utcnow(cls) -> _datetime:  # type: ignore[override]
            return _datetime.fromtimestamp(clock.time(), timezone.utc).replace(tzinfo=None)

        def __reduce_ex__(self, protocol: Any) -> Any:
            return (_datetime, super().__reduce__()[1])

    return VirtualDatetime


def patch_modules(clock: AnchoredClock, undo: list[Callable[[], None]]) -> None:
    """Every imported module under ``PREFIXES`` (``PRELOAD`` imported first) reads ``clock``
    (a ``VirtualTime`` or an ``event_clock.EventClock``) for ``time`` and ``datetime``; ``undo``
    gets how to put each name back."""
    for name in PRELOAD:
        try:
            import_module(name)
        except ModuleNotFoundError:  # an older checkout (a "before" row) lacks some
            if not name.startswith("meshrun."):
                raise
    dt = virtual_datetime(clock)
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith(PREFIXES):
            _patch_module(module, clock, dt, undo)


def _patch_module(
    module: ModuleType, clock: AnchoredClock, dt: type[_datetime], undo: list[Callable[[], None]]
) -> None:
    """Replace the clock names in one module's globals, noting how to put each back."""
    shim_of = {
        _time.monotonic: clock.monotonic,
        _time.time: clock.time,
        _time.perf_counter: clock.perf_counter,
        _time.sleep: clock.sleep,
    }
    for name, value in list(vars(module).items()):
        if value is _time:
            new: Any = clock
        elif value is _datetime:
            new = dt
        elif callable(value) and _hashable(value) and value in shim_of:  # from time import ...
            new = shim_of[value]
        else:
            continue
        setattr(module, name, new)
        undo.append(_setter(module, name, value))


def _setter(module: ModuleType, name: str, value: object) -> Callable[[], None]:
    return lambda: setattr(module, name, value)


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _patch_timer(clock: VirtualTime, undo: list[Callable[[], None]]) -> None:
    """torch's keep-alive thread waits ``Event.wait(interval)``: made k times longer."""
    from torch.distributed.elastic.rendezvous import utils

    timer = utils._PeriodicTimer
    init = timer.__init__

    def dilated_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._ctx.interval *= clock.k

    timer.__init__ = dilated_init  # type: ignore[method-assign]
    undo.append(lambda: setattr(timer, "__init__", init))


@contextmanager
def dilate(
    k: float,
    real: Callable[[], float] = _time.monotonic,
    real_sleep: Callable[[float], None] = _time.sleep,
) -> Iterator[VirtualTime]:
    """Within the block the rendezvous code (``PREFIXES``) runs on a clock k times slower than
    the real one; the clock is yielded, for the caller's own timing. k == 1 changes nothing.
    Handlers made inside must be done with (heartbeats stopped) before the block ends: their
    timers and cached times would otherwise mix the two clocks. ``real`` and ``real_sleep``: as
    for ``VirtualTime``."""
    clock = VirtualTime(k, real, real_sleep)
    if k == 1:
        yield clock
        return
    undo: list[Callable[[], None]] = []
    try:
        patch_modules(clock, undo)
        _patch_timer(clock, undo)
        yield clock
    finally:
        for put_back in reversed(undo):
            put_back()
