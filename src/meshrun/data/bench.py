"""The loader alone, per rank: can the data keep up with the accelerators?

``P`` processes, one per rank of a node, each read their share of a prepared token dataset
through the same path training takes (``TokenDataset``, ``ResumableSampler``,
``build_dataloader``), touching every batch (a sum over it, as a copy to the device would)
and doing nothing else. Each reports samples/s and tokens/s after warm-up batches; compare
the per-rank figure with the samples/s a training step consumes.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from meshrun.data.dataset import TokenDataset
from meshrun.data.loader import build_dataloader
from meshrun.data.sampler import ResumableSampler

__all__ = ["LoaderRate", "bench_loader", "bench_ranks"]


class _Barrier(Protocol):
    def wait(self) -> Any: ...


@dataclass(frozen=True)
class LoaderRate:
    rank: int
    samples_per_s: float
    tokens_per_s: float
    batches: int
    seconds: float


def bench_loader(
    directory: str | Path,
    *,
    seq_len: int,
    micro_batch: int,
    num_workers: int = 0,
    batches: int = 50,
    warmup: int = 5,
    rank: int = 0,
    world_size: int = 1,
    barrier: _Barrier | None = None,
) -> LoaderRate:
    """Time ``batches`` micro-batches of this rank's loader after ``warmup`` untimed ones."""
    torch.set_num_threads(1)  # one core per rank, as training leaves the loader
    ds = TokenDataset(directory, seq_len)
    sampler = ResumableSampler(
        len(ds), rank=rank, world_size=world_size, global_batch=micro_batch * world_size
    )
    loader = build_dataloader(ds, sampler, micro_batch, num_workers=num_workers, rank=rank)
    it = _endless(loader)
    for _ in range(warmup):
        next(it)
    if barrier is not None:  # all ranks time the same window: they share the node
        barrier.wait()
    t0 = time.perf_counter()
    checksum = 0
    for _ in range(batches):
        checksum += int(next(it)["input"].sum())  # touch the data, as a copy to the device does
    seconds = time.perf_counter() - t0
    samples = batches * micro_batch
    return LoaderRate(rank, samples / seconds, samples * seq_len / seconds, batches, seconds)


def bench_ranks(directory: str | Path, nproc: int, **kwargs: Any) -> list[LoaderRate]:
    """:func:`bench_loader` in ``nproc`` processes at once (ranks of one node), by rank."""
    if nproc == 1:
        return [bench_loader(directory, **kwargs)]
    ctx = multiprocessing.get_context("spawn")  # loaders may start their own workers
    with ctx.Manager() as manager, ProcessPoolExecutor(nproc, mp_context=ctx) as pool:
        barrier = manager.Barrier(nproc)
        futures = [
            pool.submit(
                bench_loader, str(directory), rank=r, world_size=nproc, barrier=barrier, **kwargs
            )
            for r in range(nproc)
        ]
        return [f.result() for f in futures]


def _endless(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        yield from loader
