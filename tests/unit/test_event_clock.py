"""benchmarks/event_clock.py: the event clock on which ``rdzv_scale.py`` runs thousands of
agents. Virtual time moves only when every simulated thread waits on it, so these tests read
it without any timing window: a thread's own CPU (charged to its clock, a few ms at most
here) is the only slack allowed."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from types import ModuleType

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import dynamic_rendezvous, utils

import scripts

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
CPU = 0.25  # virtual seconds a test thread's own Python may add before a wait


def _load(name: str, file: str) -> ModuleType:
    """A benchmark script as a module, by its path (benchmarks/ is no package; each script
    puts its own folder on sys.path for its siblings)."""
    return scripts.load(BENCH / file, name, register=True)  # for its dataclasses


def _clock_module() -> ModuleType:
    return _load("_event_clock_under_test", "event_clock.py")


def _run(*targets: object) -> None:
    """Every target in a thread of its own, all started before any runs: a thread that waits
    on the clock while the others are still to start would let it move past their waits (a
    thread not yet started does not hold time still)."""
    go = threading.Barrier(len(targets) + 1)

    def started(target: object) -> None:
        go.wait()
        target()  # type: ignore[operator]

    threads = [threading.Thread(target=started, args=(t,), daemon=True) for t in targets]
    for t in threads:
        t.start()
    go.wait()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a simulated thread never woke"


def test_time_jumps_to_each_wake_up_in_order() -> None:
    clock = _clock_module().EventClock()
    woke: list[tuple[str, float]] = []

    def sleeper(name: str, seconds: float) -> object:
        return lambda: (clock.sleep(seconds), woke.append((name, clock.elapsed())))

    try:
        _run(sleeper("long", 600.0), sleeper("short", 30.0), sleeper("mid", 120.0))
    finally:
        clock.close()
    assert [name for name, _ in woke] == ["short", "mid", "long"]
    for (_, at), want in zip(woke, [30.0, 120.0, 600.0], strict=True):
        assert want <= at < want + CPU


def test_time_stands_still_while_a_thread_works() -> None:
    clock = _clock_module().EventClock()
    busy, release = threading.Event(), threading.Event()
    seen: list[float] = []

    def worker() -> None:  # blocks on something that is not the clock
        busy.set()
        release.wait()

    def sleeper() -> None:
        clock.sleep(5.0)
        seen.append(clock.elapsed())

    try:
        threads = [threading.Thread(target=f, daemon=True) for f in (worker, sleeper)]
        for t in threads:
            t.start()
        busy.wait()
        # The sleeper waits on the clock, the worker does not: however long this real wait,
        # the clock must not move.
        threads[1].join(timeout=0.5)
        assert clock.elapsed() == 0.0 and not seen
        release.set()
        for t in threads:
            t.join(timeout=60)
    finally:
        clock.close()
    assert seen and 5.0 <= seen[0] < 5.0 + CPU


def test_a_set_event_wakes_its_waiter_before_the_timeout() -> None:
    clock = _clock_module().EventClock()
    event = clock.event()
    got: list[tuple[bool, float]] = []

    def waiter() -> None:
        got.append((clock.wait_event(event, 100.0), clock.elapsed()))

    def setter() -> None:
        clock.sleep(3.0)
        event.set()

    try:
        _run(waiter, setter)
        _run(lambda: got.append((clock.wait_event(event, 50.0), clock.elapsed())))
    finally:
        clock.close()
    (first, at), (again, at2) = got
    assert first and 3.0 <= at < 3.0 + CPU  # woken by the set, not at 100
    assert again and at2 == at  # already set: no wait at all


def test_torchs_keep_alive_timer_runs_on_the_clock_and_stops_when_told() -> None:
    module = _clock_module()
    init, run = utils._PeriodicTimer.__init__, utils._PeriodicTimer.__dict__["_run"]
    fired: list[float] = []
    with module.events() as clock:
        timer = utils._PeriodicTimer(timedelta(seconds=5), lambda: fired.append(clock.elapsed()))

        def agent() -> None:
            timer.start()
            clock.sleep(12.0)
            timer.cancel()  # joins the timer's thread: its wait must end on the stop event

        _run(agent)
        assert dynamic_rendezvous.time is clock  # torch's handler reads the clock
    assert len(fired) == 2
    assert 5.0 <= fired[0] < 5.0 + CPU and 10.0 <= fired[1] < 10.0 + 2 * CPU
    # Every object replaced is back.
    assert utils._PeriodicTimer.__init__ is init
    assert utils._PeriodicTimer.__dict__["_run"] is run
    assert dynamic_rendezvous.time is not clock


def test_a_blocking_get_of_a_key_not_yet_set_waits_on_the_clock() -> None:
    module = _clock_module()
    clock = module.EventClock()
    store = module.ClockedStore(HashStore(), clock)
    got: list[tuple[bytes, float]] = []

    def rank1() -> None:  # torch's handler: rank 1 reads the address rank 0 has yet to set
        got.append((store.get("MASTER_ADDR"), clock.elapsed()))

    def rank0() -> None:
        clock.sleep(2.0)
        store.set("MASTER_ADDR", b"10.0.0.1")

    try:
        _run(rank1, rank0)
    finally:
        clock.close()
    assert got[0][0] == b"10.0.0.1"
    assert 2.0 <= got[0][1] < 2.0 + CPU


def test_rdzv_scale_takes_event_as_a_dilation_and_refuses_nonsense() -> None:
    bench = _load("_rdzv_scale_args", "rdzv_scale.py")
    assert bench._backends("meshrun,c10d") == ["meshrun", "c10d"]
    for bad in ("both", "meshrun,etcd", ""):
        with pytest.raises(Exception, match="not a backend; use meshrun or c10d"):
            bench._backends(bad)
    assert bench._dilation("event") == "event"
    assert bench._dilation("4") == 4.0
    for bad in ("0", "-2", "fast"):
        with pytest.raises(Exception, match="a number > 0, or event"):
            bench._dilation(bad)
    assert bench._keep_alive("1") == 1
    for bad in ("0", "0.5", "-1", "x"):
        with pytest.raises(Exception, match="whole seconds >= 1"):
            bench._keep_alive(bad)


def test_a_wait_for_a_key_ends_with_the_set_of_another_agents_store_without_polls() -> None:
    module = _clock_module()
    clock = module.EventClock()
    shared = HashStore()
    checks: list[str] = []

    class Counted:  # each agent's own client of the one store, its checks counted
        def check(self, keys: list[str]) -> bool:
            checks.extend(keys)
            return shared.check(keys)

        def get(self, key: str) -> bytes:
            return shared.get(key)

        def set(self, key: str, value: bytes) -> None:
            shared.set(key, value)

    waiting = module.ClockedStore(Counted(), clock)
    setting = module.ClockedStore(Counted(), clock)
    got: list[tuple[bytes, float]] = []

    def rank1() -> None:
        got.append((waiting.get("MASTER_PORT"), clock.elapsed()))

    def rank0() -> None:
        clock.sleep(7.5)  # longer than the fallback poll's 1 s
        setting.set("MASTER_PORT", b"29500")

    try:
        _run(rank1, rank0)
    finally:
        clock.close()
    assert got[0][0] == b"29500"
    assert 7.5 <= got[0][1] < 7.5 + CPU
    # A real store holds a get until the key is set: one request. Here a check, one more
    # once the wait is registered, one per fallback poll (1 s), the setter's own (its set is
    # not answered) and the last: 11 over 7.5 s, where the 10 ms polls made 751.
    assert len(checks) == 11, len(checks)
    assert clock.missed_sets == 0


def test_a_key_set_past_the_clocked_stores_is_found_by_the_fallback_poll_and_counted() -> None:
    module = _clock_module()
    clock = module.EventClock()
    shared = HashStore()
    store = module.ClockedStore(shared, clock)
    got: list[float] = []

    def rank1() -> None:
        store.get("MASTER_PORT")
        got.append(clock.elapsed())

    def elsewhere() -> None:  # not through a ClockedStore: no wake-up
        clock.sleep(2.5)
        shared.set("MASTER_PORT", b"29500")

    try:
        _run(rank1, elsewhere)
    finally:
        clock.close()
    assert 3.0 <= got[0] < 3.0 + CPU  # the poll after the set (1 s each)
    assert clock.missed_sets == 1


def test_uncharged_work_with_a_collectors_pass_inside_never_puts_the_mark_ahead() -> None:
    """The CPU of an ``uncharged()`` block moves the thread's charge mark, and so does a
    collector's pass (``gc_pass``); a pass inside the block counted by both put the mark
    ahead of the thread's CPU, and its next wait began early (a 512-node round took 2.0
    virtual seconds instead of 1.3)."""
    import gc
    import time

    clock = _clock_module().EventClock()
    seen: list[tuple[float, float, float]] = []
    garbage = [[i] for i in range(200_000)]  # a pass over them costs ms, more than the start

    def agent() -> None:
        with clock.uncharged():
            gc.collect()
        seen.append((clock._cpu.mark, time.thread_time(), clock._cpu.gc_in))

    gc.callbacks.append(clock.gc_pass)
    try:
        thread = threading.Thread(target=agent, daemon=True)
        thread.start()
        thread.join(timeout=60)
    finally:
        gc.callbacks.remove(clock.gc_pass)
        clock.close()
    del garbage
    ((mark, cpu, gc_in),) = seen
    assert gc_in > 0.0 and mark <= cpu
    assert clock.uncharged_s <= cpu - gc_in + 1e-6
