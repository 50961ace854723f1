"""Loader start-up checks (cores, /dev/shm) and the data-wait clock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from torch.utils.data import SequentialSampler

from meshrun.data import build_dataloader
from meshrun.data.checks import SHM_PER_WORKER, loader_resource_problems
from meshrun.data.loader import WaitClock


def test_no_workers_no_checks() -> None:
    assert loader_resource_problems(0, 8, cores=1, shm_free=0) == []


def test_too_many_workers_for_the_cores_names_the_key_and_a_fit() -> None:
    plenty = 10 * 2**30
    assert loader_resource_problems(3, 4, cores=16, shm_free=plenty) == []
    (problem,) = loader_resource_problems(4, 4, cores=16, shm_free=plenty)
    assert "data.num_workers = 4 x 4 processes" in problem
    assert "16 loader workers + 4 training processes for 16 cores" in problem
    assert "--data.num_workers=3" in problem


def test_small_dev_shm_is_reported_with_the_fix() -> None:
    (problem,) = loader_resource_problems(2, 2, cores=64, shm_free=64 * 2**20)
    assert problem.startswith("/dev/shm has 64 MiB free; 4 loader workers")
    assert "--shm-size" in problem and "bus error" in problem
    assert loader_resource_problems(2, 2, cores=64, shm_free=4 * SHM_PER_WORKER) == []


def test_build_dataloader_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "100000")  # more processes than any machine's cores
    with pytest.warns(UserWarning, match="compete for CPU"):
        build_dataloader(range(4), SequentialSampler(range(4)), 1, num_workers=1)  # type: ignore[arg-type]


class FakeClock:
    """loader.py's ``time.perf_counter``, moved by hand: the figures are exact on any machine."""

    def __init__(self) -> None:
        self.now = 50.0

    def perf_counter(self) -> float:
        return self.now


def slow(clock: FakeClock, n: int, delay: float) -> Iterator[int]:
    for i in range(n):
        clock.now += delay  # producing an item takes `delay`
        yield i


def test_wait_clock_measures_time_blocked_in_next(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeClock()
    monkeypatch.setattr("meshrun.data.loader.time", fake)
    clock = WaitClock()
    items = []
    for i in clock.wrap(slow(fake, 3, 0.05)):
        items.append(i)
        fake.now += 0.15  # "compute": must not count as waiting
    assert items == [0, 1, 2]
    assert clock.take() == pytest.approx(0.15, abs=1e-9)  # three waits of 0.05 s, not 0.6 s
    assert clock.take() == 0.0


def test_wait_clock_counts_the_wait_for_the_end_of_the_loader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeClock()
    monkeypatch.setattr("meshrun.data.loader.time", fake)

    def ends_slowly() -> Iterator[int]:
        yield 1
        fake.now += 0.2  # e.g. workers shutting down at the epoch's end

    clock = WaitClock()
    assert list(clock.wrap(ends_slowly())) == [1]
    assert clock.take() == pytest.approx(0.2, abs=1e-9)
