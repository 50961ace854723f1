"""build_dataloader: micro-batches, per-rank/per-worker seeding, disjoint ranks."""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, SequentialSampler

from meshrun.data import ResumableSampler, build_dataloader


class Indices(Dataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class Noise(Dataset[torch.Tensor]):
    """Each item is (worker id, torch, NumPy and Python random draws)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        info = torch.utils.data.get_worker_info()
        worker = -1 if info is None else info.id
        draws = [torch.rand(1).item(), float(np.random.rand()), random.random()]
        return torch.tensor([worker, *draws], dtype=torch.float64)


def draws_by_worker(rank: int, seed: int = 0) -> dict[int, list[list[float]]]:
    loader = build_dataloader(
        Noise(), SequentialSampler(range(8)), 1, num_workers=2, seed=seed, rank=rank
    )
    out: dict[int, list[list[float]]] = {0: [], 1: []}
    for batch in loader:
        out[int(batch[0, 0])].append(batch[0, 1:].tolist())
    return out


def test_train_batches_have_micro_batch_size() -> None:
    sampler = ResumableSampler(42, rank=1, world_size=2, global_batch=8)
    loader = build_dataloader(Indices(42), sampler, 2)
    assert len(sampler) == 24  # 6 global batches of 4 per rank, the last spilling over
    assert len(loader) == 12
    assert [len(b) for b in loader] == [2] * 12


def test_worker_seeding_differs_per_rank_and_worker_and_repeats() -> None:
    rank0, again, rank1 = draws_by_worker(0), draws_by_worker(0), draws_by_worker(1)
    assert rank0 == again
    assert rank0[0] != rank1[0] and rank0[1] != rank1[1]
    for source in range(3):  # torch, NumPy, Python: each must differ between workers
        assert rank0[0][0][source] != rank0[1][0][source]
    assert draws_by_worker(0, seed=1) != rank0


def test_worker_init_fn_reseeds_every_rng() -> None:
    loader = build_dataloader(Indices(4), SequentialSampler(range(4)), 1, seed=3, rank=1)
    assert loader.worker_init_fn is not None

    def draw() -> tuple[float, float, float]:
        assert loader.worker_init_fn is not None
        loader.worker_init_fn(0)
        return torch.rand(1).item(), float(np.random.rand()), random.random()

    state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        assert draw() == draw()
    finally:
        torch.set_rng_state(state[0])
        np.random.set_state(state[1])
        random.setstate(state[2])


def test_ranks_load_disjoint_samples() -> None:
    loaded = []
    for rank in range(2):
        sampler = ResumableSampler(24, rank=rank, world_size=2, global_batch=8)
        loader = build_dataloader(Indices(24), sampler, 2, rank=rank)
        loaded.append([int(i) for batch in loader for i in batch])
    assert set(loaded[0]).isdisjoint(loaded[1])
    assert sorted(loaded[0] + loaded[1]) == list(range(24))


def test_loader_passes_on_plain_loop_epoch_advance() -> None:
    sampler = ResumableSampler(16, rank=0, world_size=1, global_batch=4)
    loader = build_dataloader(Indices(16), sampler, 4)
    first = [int(i) for b in loader for i in b]
    second = [int(i) for b in loader for i in b]
    assert sampler.epoch == 2
    assert sorted(first) == sorted(second) == list(range(16)) and first != second


def test_straddling_micro_batches_warn() -> None:
    sampler = ResumableSampler(24, rank=0, world_size=2, global_batch=12)
    with pytest.warns(UserWarning, match="straddle"):
        build_dataloader(Indices(24), sampler, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_dataloader(Indices(24), sampler, 3)
        eval_sampler = ResumableSampler(24, rank=0, world_size=2, global_batch=12, mode="eval")
        build_dataloader(Indices(24), eval_sampler, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"micro_batch": 0}, "micro_batch must be >= 1, got 0"),
        ({"num_workers": -1}, "num_workers must be >= 0, got -1"),
        ({"prefetch_factor": 2}, "prefetch_factor"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, int], match: str) -> None:
    args: dict[str, Any] = {"micro_batch": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        build_dataloader(Indices(4), SequentialSampler(range(4)), **args)


def test_workers_persist_and_generator_is_seeded_per_rank() -> None:
    def build(rank: int, num_workers: int = 2) -> torch.utils.data.DataLoader[int]:
        return build_dataloader(
            Indices(4), SequentialSampler(range(4)), 1, num_workers=num_workers, rank=rank
        )

    assert build(0).persistent_workers and not build(0, num_workers=0).persistent_workers
    seeds = [build(rank).generator.initial_seed() for rank in (0, 0, 1)]
    assert seeds[0] == seeds[1] != seeds[2]


def test_workers_start_from_a_fork_server_and_keep_their_seeds() -> None:
    # A worker forked from the multi-threaded training process once deadlocked as it started
    # (inside os.fork(), CPython gh-112275): the default is a fork server, which has no threads.
    loader = build_dataloader(Indices(4), SequentialSampler(range(4)), 1, num_workers=2)
    context = loader.multiprocessing_context
    assert context is not None and context.get_start_method() == "forkserver"
    # Seeds per (seed, rank, worker) reach workers that unpickle their init function, and
    # match a forked worker's draws.
    forked = build_dataloader(
        Noise(), SequentialSampler(range(8)), 1, num_workers=2, start_method="fork"
    )
    by_fork: dict[int, list[list[float]]] = {0: [], 1: []}
    for batch in forked:
        by_fork[int(batch[0, 0])].append(batch[0, 1:].tolist())
    assert draws_by_worker(0) == by_fork


def test_a_dataset_workers_cannot_receive_is_refused_naming_the_setting() -> None:
    class Local(Dataset[int]):  # defined in a function: pickle cannot name it
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> int:
            return i

    with pytest.raises(ValueError, match=r"data\.num_workers = 2 with data\.worker_start") as e:
        build_dataloader(Local(), SequentialSampler(range(4)), 1, num_workers=2)
    assert "--data.num_workers=0" in str(e.value) and "--data.worker_start=fork" in str(e.value)
    build_dataloader(Local(), SequentialSampler(range(4)), 1)  # no workers: nothing to pickle
    forked = build_dataloader(Local(), None, 1, num_workers=1, start_method="fork")
    assert [int(b) for b in forked] == [0, 1, 2, 3]
