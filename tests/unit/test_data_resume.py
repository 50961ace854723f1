"""Resume cost independent of position; workers keep the order; iterable datasets resume too."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset

import meshrun.data.sampler as sampler_module
from meshrun.data import ResumableIterable, ResumableSampler, build_dataloader


class Ids(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def first_batch_after_resume(n: int, consumed: int) -> list[int]:
    sampler = ResumableSampler(n, rank=1, world_size=4, global_batch=64, seed=5)
    loader = build_dataloader(Ids(n), sampler, 8)
    sampler.load_state_dict({**sampler.state_dict(), "consumed": consumed})
    return next(iter(loader)).tolist()


def test_resume_cost_does_not_grow_with_the_position(monkeypatch: pytest.MonkeyPatch) -> None:
    # The work of a resume is counted, not timed (a wall-clock bound flakes on a loaded
    # machine): a resume keys the permutation of its epoch (and of the one before, for a
    # batch that spans the boundary), never one per epoch since the start.
    drawn: list[int] = []
    real = sampler_module.KeyedPermutation

    def counting(n: int, key: int) -> Any:
        drawn.append(1)
        return real(n, key)

    monkeypatch.setattr(sampler_module, "KeyedPermutation", counting)
    n = 1_000_003  # a million samples; a batch at an epoch's end spans two permutations
    for consumed in (0, 64 * 10_000, n * 1000 - 32, 64 * 10**12):
        drawn.clear()
        batch = first_batch_after_resume(n, consumed)
        assert 1 <= len(drawn) <= 2, f"resume at {consumed} keyed {len(drawn)} permutations"
        # Exactly the sampler's positions consumed + 1 + 4k: no replay from 0.
        again = ResumableSampler(n, rank=1, world_size=4, global_batch=64, seed=5)
        again.load_state_dict({**again.state_dict(), "consumed": consumed})
        assert again.epoch == consumed // n
        assert batch == list(itertools.islice(iter(again), 8))


def test_workers_do_not_change_a_ranks_order() -> None:
    def ids(workers: int) -> list[int]:
        sampler = ResumableSampler(40, rank=0, world_size=2, global_batch=8, seed=2)
        loader = build_dataloader(Ids(40), sampler, 2, num_workers=workers)
        return [i for batch in loader for i in batch.tolist()]

    assert ids(0) == ids(2)


class Positions:
    """An endless stream whose item at position p is a scrambled id, skippable by count."""

    def __init__(self) -> None:
        self.started_at: list[int] = []

    def iter_from(self, position: int) -> Iterator[int]:
        self.started_at.append(position)
        p = position
        while True:
            yield (p * 7919) % 1000
            p += 1


G = 24  # divisible by D x micro-batch 2 for every D in 1..4


def iterable_ids(d: int, steps: int, consumed: int = 0, workers: int = 0) -> list[int]:
    """Global order of ``steps`` global batches of G read by ``d`` ranks of an iterable."""
    per_rank: list[list[int]] = []
    for rank in range(d):
        ds = ResumableIterable(Positions(), rank=rank, world_size=d, global_batch=G, micro_batch=2)
        ds.load_state_dict({"consumed": consumed})
        loader = DataLoader(ds, batch_size=2, num_workers=workers)
        it = iter(loader)
        per_rank.append([i for _ in range(steps * G // d // 2) for i in next(it).tolist()])
    order = [-1] * (steps * G)
    for r, ids in enumerate(per_rank):
        for j, sample in enumerate(ids):
            s, k = divmod(j, G // d)
            order[s * G + r + k * d] = sample
    return order


def test_iterable_order_is_world_size_independent_and_resumes_across_world_sizes() -> None:
    reference = [(p * 7919) % 1000 for p in range(10 * G)]
    for d in (1, 2, 3, 4):
        assert iterable_ids(d, 10) == reference, f"D={d}"
    resumed = (
        iterable_ids(4, 3) + iterable_ids(2, 4, consumed=3 * G) + iterable_ids(3, 3, consumed=7 * G)
    )
    assert resumed == reference
    assert iterable_ids(2, 10, workers=2) == reference  # workers split micro-batches in turn


def test_iterable_skips_by_count_and_checks_its_arguments() -> None:
    source = Positions()
    ds = ResumableIterable(source, rank=0, world_size=2, global_batch=8, micro_batch=2)
    ds.step()
    ds.step()
    assert ds.state_dict()["consumed"] == 16
    next(iter(ds))
    assert source.started_at == [16]  # started at the position, nothing replayed
    with pytest.raises(ValueError, match="multiple of world_size"):
        ResumableIterable(source, rank=0, world_size=2, global_batch=6, micro_batch=2)
