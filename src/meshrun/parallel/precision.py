"""Mixed precision from ``parallel.param_dtype`` / ``parallel.reduce_dtype``.

FSDP2 (zero 2/3): parameters all-gathered (and computed) in ``param_dtype``, gradients
reduce-scattered in ``reduce_dtype``; the sharded master copy and the optimizer stay fp32.
DDP (zero 0/1): the model's forward runs under ``torch.autocast(param_dtype)``; parameters,
gradients and their all-reduce stay fp32 (compress the all-reduce with ``ddp_comm_hook``).

float16 has 5 exponent bits: small gradients underflow to zero, so an fp16 run scales the loss
by a :class:`ShardedGradScaler`. Its infinity check is per rank over the gradients that rank
holds (only a shard under FSDP2), so it all-reduces the "found inf" flag over the world: every
rank skips the same steps and keeps the same scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from meshrun.config import ConfigError, ParallelConfig

# FSDP (and the DTensor it imports, about a second of CPU) is imported where an FSDP2 policy or
# an fp16 scaler is built: a DDP run in fp32 or bf16 never imports it.
if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_mp_policy(cfg: ParallelConfig, zero: int) -> MixedPrecisionPolicy | None:
    """FSDP2's mixed-precision policy (zero 2/3); None under DDP, after checking that
    ``reduce_dtype`` asks nothing of DDP that it cannot do."""
    if zero < 2 and cfg.reduce_dtype != "float32":
        raise ConfigError(
            f"parallel.reduce_dtype = {cfg.reduce_dtype!r} is an FSDP2 policy (zero 2 or 3), but "
            f"parallel.zero = {zero}; under DDP compress the all-reduce with "
            "parallel.ddp_comm_hook=bf16 (or fp16), or set parallel.zero=3"
        )
    if zero < 2:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype]
    )


def apply_autocast(model: nn.Module, cfg: ParallelConfig, device: torch.device) -> None:
    """DDP's mixed precision: the forward of ``model`` (before DDP wraps it) runs under
    ``torch.autocast``, so the user's loop needs no change. A no-op for float32."""
    if cfg.param_dtype == "float32":
        return
    forward = model.forward
    model.forward = torch.autocast(device.type, dtype=DTYPES[cfg.param_dtype])(forward)


def build_grad_scaler(cfg: ParallelConfig, device: torch.device) -> ShardedGradScaler | None:
    """The loss scaler an fp16 run needs (None for fp32/bf16: their exponent range is fp32's).
    ShardedGradScaler, not torch.amp.GradScaler: the same algorithm plus the all-reduce of the
    infinity flag, which sharded gradients need and replicated ones do not mind."""
    if cfg.param_dtype != "float16":
        return None
    from meshrun.parallel.scaler import MeshGradScaler

    return MeshGradScaler(device=device.type)
