"""Mixed precision for FSDP2: parameters all-gathered (and computed) in ``param_dtype``,
gradients reduce-scattered in ``reduce_dtype``; the sharded master copy and the optimizer stay
fp32. Under DDP, mixed precision is the user's ``torch.autocast`` (their loop, their choice)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from meshrun.config import ConfigError, ParallelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_mp_policy(cfg: ParallelConfig, zero: int) -> MixedPrecisionPolicy:
    if zero < 2 and (cfg.param_dtype, cfg.reduce_dtype) != ("float32", "float32"):
        raise ConfigError(
            f"parallel.param_dtype = {cfg.param_dtype!r} / reduce_dtype = {cfg.reduce_dtype!r} "
            f"are FSDP2 policies (zero 2 or 3), but parallel.zero = {zero}; under DDP use "
            "torch.autocast in your loop and parallel.ddp_comm_hook=bf16, or set parallel.zero=3"
        )
    return MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype]
    )
