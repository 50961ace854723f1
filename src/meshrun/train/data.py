"""The data and learning-rate side of :class:`meshrun.Run`, as plain functions: the resumable
sampler and loader over this rank's share, and the LR rules of ``[optim]`` (data/,
runtime/schedule.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset

from meshrun.config import Config, ConfigError, OptimConfig
from meshrun.data import ResumableSampler, build_dataloader
from meshrun.ft.data import data_share
from meshrun.runtime.schedule import build_lr_scheduler, scale_lr
from meshrun.runtime.state import TrainState

Mode = Literal["train", "eval"]


def scaled_lr(cfg: Config, base_lr: float | None, log: logging.Logger | None) -> float:
    """``run.scaled_lr``: ``base_lr`` (default ``optim.lr``) scaled to the global batch; a
    change is said on ``log`` (the main rank's)."""
    o = cfg.optim
    base = o.lr if base_lr is None else base_lr
    lr = scale_lr(base, cfg.data.global_batch, o.ref_batch, o.lr_scaling)
    if lr != base and log is not None:
        log.info(
            "lr %.3g -> %.3g (%s scaling, global batch %d vs reference %d)",
            base,
            lr,
            o.lr_scaling,
            cfg.data.global_batch,
            o.ref_batch,
        )
    return lr


def registered_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, state: TrainState
) -> torch.optim.lr_scheduler.LambdaLR:
    """``run.lr_scheduler``: warmup + decay, registered (the loop steps it, checkpoints save it)."""
    sched = build_lr_scheduler(optimizer, cfg)
    state.schedulers.append(sched)
    return sched


def rank_sampler(
    dataset_len: int, mode: Mode, cfg: Config, dp_rank: int, dp_size: int
) -> ResumableSampler:
    """``run.sampler``: this data-parallel rank's share (under replica groups, of its group's)."""
    rank, world = dp_rank, dp_size
    if mode == "train":  # with replica groups, this group's share of the global batch
        rank, world = data_share(cfg.fault_tolerance, rank, world)
    return ResumableSampler(
        dataset_len,
        rank=rank,
        world_size=world,
        global_batch=cfg.data.global_batch,
        seed=cfg.job.seed,
        shuffle=cfg.data.shuffle if mode == "train" else False,
        mode=mode,
    )


def rank_dataloader(
    dataset: Dataset[Any],
    micro_batch: int | None,
    mode: Mode,
    collate_fn: Callable[[list[Any]], Any] | None,
    cfg: Config,
    *,
    rank: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
) -> DataLoader[Any]:
    """``run.dataloader``: a loader over this rank's share in a resumable order; a training
    micro-batch other than ``data.micro_batch`` is refused (the accumulation is derived from it)."""
    mb = cfg.data.micro_batch if micro_batch is None else micro_batch
    if mode == "train" and mb != cfg.data.micro_batch:
        raise ConfigError(
            f"run.dataloader(micro_batch={mb}) differs from data.micro_batch = "
            f"{cfg.data.micro_batch}; set --data.micro_batch={mb} instead so the "
            "accumulation is derived from it"
        )
    return build_dataloader(
        dataset,
        rank_sampler(len(dataset), mode, cfg, dp_rank, dp_size),  # type: ignore[arg-type]
        mb,
        num_workers=cfg.data.num_workers,
        seed=cfg.job.seed,
        rank=rank,
        collate_fn=collate_fn,
        pin_memory=device.type == "cuda",
        start_method=cfg.data.worker_start,
    )
