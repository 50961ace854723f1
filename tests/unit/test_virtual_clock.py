"""benchmarks/virtual_clock.py: the dilated clock that lets ``rdzv_scale.py`` simulate more
agents than the machine's cores keep up with. A fake real clock and sleep are injected, so the
rate is asserted exactly, never through a timing window; and leaving the block puts back every
object it replaced (torch's and meshrun's, and a module it was never told about)."""

from __future__ import annotations

import pickle
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous, utils

import scripts
from meshrun.launch.trust import heartbeats

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "virtual_clock.py"


def _clock_module() -> ModuleType:
    return scripts.load(SCRIPT, "_virtual_clock_under_test")


class FakeReal:
    """A real clock that moves only when told to; its sleep moves it and records the length."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_virtual_time_runs_k_times_slower_and_sleeps_k_times_longer() -> None:
    real = FakeReal()
    clock = _clock_module().VirtualTime(4, real, real.sleep)
    m0, t0, p0 = clock.monotonic(), clock.time(), clock.perf_counter()
    assert m0 == real.now  # continuous with the real clock at the start
    real.now += 8.0
    assert clock.monotonic() - m0 == pytest.approx(2.0)
    assert clock.time() - t0 == pytest.approx(2.0)
    assert clock.perf_counter() - p0 == pytest.approx(2.0)
    clock.sleep(0.05)
    assert real.slept == [pytest.approx(0.2)]
    assert clock.monotonic() - m0 == pytest.approx(2.05)
    assert clock.gmtime is time.gmtime  # the rest of the module passes through


def test_dilate_patches_rendezvous_modules_and_undo_restores_them() -> None:
    vc, real = _clock_module(), FakeReal()
    # A module the clock does not name (as a new one under meshrun.launch would be), importing
    # the clock three ways.
    probe = ModuleType("meshrun.launch._clock_probe")
    probe.time, probe.datetime, probe.monotonic = time, datetime, time.monotonic  # type: ignore[attr-defined]
    sys.modules[probe.__name__] = probe
    originals = (
        dynamic_rendezvous.time,
        dynamic_rendezvous.datetime,
        utils.time,
        heartbeats.time,
        heartbeats.datetime,
        utils._PeriodicTimer.__init__,
    )
    try:
        with vc.dilate(4, real, real.sleep) as clock:
            for module in (dynamic_rendezvous, utils, heartbeats, probe):
                assert module.time is clock
            assert probe.monotonic == clock.monotonic
            seen = dynamic_rendezvous.datetime.now(timezone.utc)
            real.now += 40.0  # 10 virtual seconds
            later = heartbeats.datetime.now(timezone.utc)
            assert abs((later - seen).total_seconds() - 10.0) < 1e-3  # datetime's microseconds
            assert isinstance(later, dynamic_rendezvous.datetime)
            assert type(later) is datetime  # plain: pickled into states torch unpickles
            parsed = heartbeats.datetime.fromisoformat("2026-12-07T04:00:00+00:00")
            assert type(pickle.loads(pickle.dumps(parsed))) is datetime
            utils._delay(0.05)  # torch's join spread and its 1 s polls
            assert real.slept == [pytest.approx(0.2)]
            timer = utils._PeriodicTimer(timedelta(seconds=5), lambda: None)
            assert timer._ctx.interval == 20.0  # the keep-alive thread's Event.wait
        after = (
            dynamic_rendezvous.time,
            dynamic_rendezvous.datetime,
            utils.time,
            heartbeats.time,
            heartbeats.datetime,
            utils._PeriodicTimer.__init__,
        )
        assert all(a is o for a, o in zip(after, originals, strict=True))
        assert probe.time is time and probe.datetime is datetime
        assert probe.monotonic is time.monotonic
        assert utils._PeriodicTimer(timedelta(seconds=5), lambda: None)._ctx.interval == 5.0
    finally:
        del sys.modules[probe.__name__]


def test_no_dilation_changes_nothing() -> None:
    with _clock_module().dilate(1) as clock:
        assert dynamic_rendezvous.time is time
        assert clock.k == 1
