"""The world-size-independent order for iterable datasets that can start at a position.

A stream that cannot be indexed (records read in order, generated text) can still resume
exactly if it can *skip by count*: ``source.iter_from(p)`` yields the global stream from
position ``p`` on (seeking a file, skipping records; the source decides how cheaply). The
global stream is cut as the map-style sampler cuts it: global batches of ``G`` consecutive
positions, rank ``r`` of ``D`` taking every ``D``-th position of each, so the state is again
just ``consumed`` and a resume on another ``D`` continues exactly. Each rank reads the whole
stream and keeps its share: an iterable source has no random access to offer.

With DataLoader workers, worker ``w`` of ``W`` keeps this rank's micro-batches ``m`` with
``m % W == w``; the DataLoader takes batches from its workers in turn, so the rank still sees
its items in stream order. The stream is endless: the source's epochs are its own business
(``iter_from`` is called with positions past its length and wraps, or ends the run).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, Protocol, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

__all__ = ["ResumableIterable", "SkippableSource"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class SkippableSource(Protocol[T_co]):
    def iter_from(self, position: int) -> Iterator[T_co]:
        """Items of the global stream from ``position`` (0-based, all ranks together) on."""
        ...


class ResumableIterable(IterableDataset[T], Generic[T]):
    """This rank's share of ``source``'s stream, resumable at any world size (module doc).

    Build the DataLoader with ``batch_size=micro_batch`` (``build_dataloader(ds, None,
    micro_batch)`` or a plain DataLoader); :meth:`step` must follow each optimizer step
    (``run.steps`` does it for a loader over this dataset); load a checkpoint's
    :meth:`state_dict` *before* the first ``iter()`` (persistent workers copy the dataset when
    they start): ``run.resume(model, optimizer, data=ds)`` registers and loads it.
    """

    def __init__(
        self,
        source: SkippableSource[T],
        *,
        rank: int,
        world_size: int,
        global_batch: int,
        micro_batch: int,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        per_rank, rest = divmod(global_batch, world_size)
        if rest or micro_batch < 1 or per_rank % micro_batch:
            raise ValueError(
                f"global_batch ({global_batch}) must be a multiple of world_size ({world_size}) "
                f"x micro_batch ({micro_batch}) for an iterable dataset: its micro-batches "
                "cannot straddle global batches"
            )
        self.source = source
        self.rank, self.world_size = rank, world_size
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.consumed = 0

    def step(self, global_samples: int | None = None) -> None:
        """Record one optimizer step of ``global_samples`` (default ``global_batch``)."""
        n = self.global_batch if global_samples is None else global_samples
        if n < 1:
            raise ValueError(f"global_samples must be >= 1, got {n}")
        self.consumed += n

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "global_batch": self.global_batch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        consumed = int(state["consumed"])
        if consumed < 0:
            raise ValueError(f"state 'consumed' must be >= 0, got {consumed}")
        self.consumed = consumed

    def __iter__(self) -> Iterator[T]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        mine = 0  # count of this rank's items so far
        for k, item in enumerate(self.source.iter_from(self.consumed)):
            # Global batches start at multiples of G, itself a multiple of D: the rank of a
            # position is its remainder modulo D.
            if (self.consumed + k) % self.world_size != self.rank:
                continue
            if (mine // self.micro_batch) % workers == worker:
                yield item
            mine += 1
