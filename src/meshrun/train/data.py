"""``Run``'s data and learning-rate methods: the resumable sampler and loader over this rank's
share, the step iterator, and the LR rules of ``[optim]`` (data/, runtime/schedule.py, train/loop.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset

from meshrun.config import ConfigError
from meshrun.data import ResumableSampler, build_dataloader
from meshrun.ft.data import data_share
from meshrun.runtime.schedule import build_lr_scheduler, scale_lr
from meshrun.train.base import RunFields


class DataMethods(RunFields):
    """The data half of :class:`meshrun.Run` (a mixin: ``Run`` holds the state)."""

    def scaled_lr(self, base_lr: float | None = None) -> float:
        """``base_lr`` (default ``optim.lr``) scaled by ``optim.lr_scaling`` to the global batch."""
        o = self.config.optim
        base = o.lr if base_lr is None else base_lr
        lr = scale_lr(base, self.config.data.global_batch, o.ref_batch, o.lr_scaling)
        if lr != base and self.is_main:
            self.log.info(
                "lr %.3g -> %.3g (%s scaling, global batch %d vs reference %d)",
                base,
                lr,
                o.lr_scaling,
                self.config.data.global_batch,
                o.ref_batch,
            )
        return lr

    def lr_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """Warmup + decay from ``[optim]``; stepped by ``run.optimizer_step``."""
        sched = build_lr_scheduler(optimizer, self.config.optim)
        self.state.schedulers.append(sched)
        return sched

    def sampler(
        self, dataset_len: int, *, mode: Literal["train", "eval"] = "train"
    ) -> ResumableSampler:
        """A :class:`ResumableSampler` over ``dataset_len`` samples for this rank's data-parallel
        share: ``train``, one stream of epochs (shuffled when ``data.shuffle``) whose position
        resumes on any number of ranks; ``eval``, each sample exactly once, in order, unpadded."""
        rank, world = self.dp_rank, self.dp_size
        if mode == "train":  # with replica groups, this group's share of the global batch
            rank, world = data_share(self.config.fault_tolerance, rank, world)
        return ResumableSampler(
            dataset_len,
            rank=rank,
            world_size=world,
            global_batch=self.config.data.global_batch,
            seed=self.config.job.seed,
            shuffle=self.config.data.shuffle if mode == "train" else False,
            mode=mode,
        )

    def dataloader(
        self,
        dataset: Dataset[Any],
        micro_batch: int | None = None,
        *,
        mode: Literal["train", "eval"] = "train",
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> DataLoader[Any]:
        """A DataLoader over this rank's share, in a world-size-independent resumable order."""
        mb = self.config.data.micro_batch if micro_batch is None else micro_batch
        if mode == "train" and mb != self.config.data.micro_batch:
            raise ConfigError(
                f"run.dataloader(micro_batch={mb}) differs from data.micro_batch = "
                f"{self.config.data.micro_batch}; set --data.micro_batch={mb} instead so the "
                "accumulation is derived from it"
            )
        return build_dataloader(
            dataset,
            self.sampler(len(dataset), mode=mode),  # type: ignore[arg-type]
            mb,
            num_workers=self.config.data.num_workers,
            seed=self.config.job.seed,
            rank=self.rank,
            collate_fn=collate_fn,
            pin_memory=self.device.type == "cuda",
        )

    def steps(
        self, loader: Iterable[Any], steps: int | None = None, tokens_per_sample: int | None = None
    ) -> Iterator[Any]:
        """Micro-batches on the device until ``optim.steps`` optimizer steps (see train/loop.py)."""
        if tokens_per_sample is None:  # 0 in the config: not known
            tokens_per_sample = self.config.metrics.tokens_per_sample or None
        return self.loop.steps(loader, steps, tokens_per_sample)
