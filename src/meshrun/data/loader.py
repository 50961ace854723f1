"""Build a DataLoader whose worker randomness is reproducible per rank and worker."""

from __future__ import annotations

import functools
import os
import random
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from meshrun.data.checks import loader_resource_problems
from meshrun.data.sampler import ResumableSampler, mix_seed
from meshrun.data.workers import StartMethod, warn_once, worker_context

__all__ = ["WaitClock", "build_dataloader"]

T = TypeVar("T")


def build_dataloader(
    dataset: Dataset[Any],
    sampler: Sampler[int] | None,
    micro_batch: int,
    *,
    num_workers: int = 0,
    seed: int = 0,
    rank: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    start_method: StartMethod = "forkserver",
) -> DataLoader[Any]:
    """Return a DataLoader over ``sampler``'s indices in batches of ``micro_batch``.

    Workers seed Python ``random``, NumPy and torch from (seed, rank, worker id),
    so augmentation differs between ranks and workers yet repeats run to run.
    Workers are persistent, so their random streams continue across epochs
    instead of restarting (which would repeat every epoch's augmentation). Workers start
    from a fork server by default, not as forks of this multi-threaded process (see
    data/workers.py); a dataset or ``collate_fn`` they cannot receive is refused here.
    """
    _validate(micro_batch, num_workers, prefetch_factor)
    _maybe_warn_straddle(sampler, micro_batch)
    _maybe_warn_resources(num_workers)
    init_fn = functools.partial(seed_worker, seed=seed, rank=rank)
    context = worker_context(
        start_method, num_workers, dataset=dataset, collate_fn=collate_fn, worker_init_fn=init_fn
    )
    return DataLoader(
        dataset,
        batch_size=micro_batch,
        sampler=sampler,
        # The sampler already yields whole global batches; dropping would lose data.
        drop_last=False,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        worker_init_fn=init_fn,
        generator=torch.Generator().manual_seed(mix_seed(seed, rank)),
        persistent_workers=num_workers > 0,
        prefetch_factor=prefetch_factor,
        multiprocessing_context=context,
    )


def seed_worker(worker_id: int, *, seed: int, rank: int) -> None:
    """Seed every RNG a dataset might use inside DataLoader worker ``worker_id``.

    torch seeds its own and Python's RNG per worker, but not NumPy's, so a forked
    worker would otherwise inherit the same NumPy state as all its siblings.
    """
    worker_seed = mix_seed(seed, rank, worker_id)
    random.seed(worker_seed)
    np.random.seed(worker_seed % 2**32)  # NumPy's legacy seed is 32-bit.
    torch.manual_seed(worker_seed)


def _validate(micro_batch: int, num_workers: int, prefetch_factor: int | None) -> None:
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if prefetch_factor is not None and (num_workers == 0 or prefetch_factor < 1):
        raise ValueError(
            f"prefetch_factor must be None or >= 1 with num_workers > 0, "
            f"got prefetch_factor={prefetch_factor}, num_workers={num_workers}"
        )


def _maybe_warn_resources(num_workers: int) -> None:
    # torchrun (and meshrun launch) tell each process how many share its node.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    for problem in loader_resource_problems(num_workers, local):
        warn_once(problem)


def _maybe_warn_straddle(sampler: Sampler[int] | None, micro_batch: int) -> None:
    if not isinstance(sampler, ResumableSampler) or sampler.mode != "train":
        return
    per_rank = sampler.global_batch // sampler.world_size
    if per_rank % micro_batch != 0:
        warnings.warn(
            f"global_batch // world_size = {per_rank} is not a multiple of "
            f"micro_batch = {micro_batch}: micro-batches will straddle global batches",
            stacklevel=3,
        )


class WaitClock:
    """Time spent blocked in ``next()`` on a loader: the rank's data wait.

    The step loop wraps its loader with :meth:`wrap` and calls :meth:`take` once per optimizer
    step; the share ``wait / step time`` says whether this rank's input pipeline keeps up (near
    0) or starves the accelerator. It is per rank: one slow rank's loader stalls all the others
    at the next collective, where their wait shows up as communication instead.
    """

    def __init__(self) -> None:
        self._waited_s = 0.0

    def wrap(self, iterable: Iterable[T]) -> Iterator[T]:
        it = iter(iterable)  # starting workers counts too: the step waits for it
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                self._waited_s += time.perf_counter() - t0
                return
            self._waited_s += time.perf_counter() - t0
            yield item

    def take(self) -> float:
        """Seconds waited since the last ``take()``, and reset."""
        waited, self._waited_s = self._waited_s, 0.0
        return waited
