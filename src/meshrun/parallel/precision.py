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

from types import SimpleNamespace
from typing import cast

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from meshrun.config import ConfigError, ParallelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_mp_policy(cfg: ParallelConfig, zero: int) -> MixedPrecisionPolicy:
    if zero < 2 and cfg.reduce_dtype != "float32":
        raise ConfigError(
            f"parallel.reduce_dtype = {cfg.reduce_dtype!r} is an FSDP2 policy (zero 2 or 3), but "
            f"parallel.zero = {zero}; under DDP compress the all-reduce with "
            "parallel.ddp_comm_hook=bf16 (or fp16), or set parallel.zero=3"
        )
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
    return MeshGradScaler(device=device.type)


class MeshGradScaler(ShardedGradScaler):
    """ShardedGradScaler that also unscales a mix of DTensor and plain gradients.

    Under tensor parallel the split linears' gradients are DTensors while the embeddings' and
    norms' are plain tensors; torch's scaler groups gradients by device and dtype only, and
    its foreach unscale kernel refuses a list mixing both ("got mixed torch.Tensor and
    DTensor"). Here each kind (plain, or one DeviceMesh) is unscaled on its own and the
    infinity flags are summed, so the step is skipped if any gradient is not finite."""

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        kinds: dict[object, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    kinds.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        if len(kinds) <= 1:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        found: dict[torch.device, torch.Tensor] = {}
        for params in kinds.values():
            # The parent only reads ``param_groups``: one group per kind of gradient.
            part = cast(torch.optim.Optimizer, SimpleNamespace(param_groups=[{"params": params}]))
            for dev, inf in super()._unscale_grads_(part, inv_scale, found_inf, allow_fp16).items():
                found[dev] = found[dev] + inf if dev in found else inf
        return found
