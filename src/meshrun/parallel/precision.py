"""Mixed precision from ``parallel.param_dtype`` / ``parallel.reduce_dtype``.

FSDP2 (zero 2/3): parameters all-gathered (and computed) in ``param_dtype``, gradients
reduce-scattered in ``reduce_dtype``; the sharded master copy and the optimizer stay fp32.
DDP (zero 0/1): the model's forward runs under ``torch.autocast(param_dtype)``; parameters,
gradients and their all-reduce stay fp32 (compress the all-reduce with ``ddp_comm_hook``).
torch's autocast has no rule for the grouped expert matmul (``aten::_grouped_mm``, which
transformers' MoE experts call): meshrun adds one (:func:`autocast_grouped_mm`), so the experts
compute in ``param_dtype`` as every other matmul does, and as they do under FSDP2.

float16 has 5 exponent bits: small gradients underflow to zero, so an fp16 run scales the loss
by a :class:`ShardedGradScaler`. Its infinity check is per rank over the gradients that rank
holds (only a shard under FSDP2), so it all-reduces the "found inf" flag over the world: every
rank skips the same steps and keeps the same scale.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshrun.config import ConfigError, ParallelConfig

# FSDP (and the DTensor it imports, about a second of CPU) is imported where an FSDP2 policy or
# an fp16 scaler is built: a DDP run in fp32 or bf16 never imports it.
if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger(__name__)


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
    autocast_grouped_mm(device.type)


def compute_autocast(cfg: ParallelConfig, device_type: str) -> contextlib.AbstractContextManager:
    """The precision the run computes in, as a context: ``torch.autocast(param_dtype)`` (with
    the grouped matmul's rule) or nothing for float32. For checks that must run the forward
    as the training step will (a float32 forward can fail where the run's would not)."""
    if cfg.param_dtype == "float32":
        return contextlib.nullcontext()
    autocast_grouped_mm(device_type)
    return torch.autocast(device_type, dtype=DTYPES[cfg.param_dtype])


# Autocast's dispatch keys for the devices the rule is registered on; one registration per
# process and device type (the library must stay alive for the kernel to stay registered).
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
_GROUPED_MM_LIB: list[torch.library.Library] = []
_GROUPED_MM_DEVICES: set[str] = set()


def autocast_grouped_mm(device_type: str) -> None:
    """Give ``aten::_grouped_mm`` an autocast rule on ``device_type``: inside an autocast region
    its floating inputs are cast to the autocast dtype, as autocast does for ``mm``.

    Without it (pytorch#174763), transformers casts the experts' input to the weights' dtype,
    so under DDP's autocast (fp32 weights) the experts alone compute in fp32: on CUDA that is
    the grouped matmul's slow fallback (its fast kernel takes bf16 only), and torch's meta
    kernel, which meshrun's memory trace and pipeline check run on, refuses fp32 outright.
    Process-wide but idle outside autocast regions; registered once per device type."""
    key = _AUTOCAST_KEYS.get(device_type)
    if key is None or device_type in _GROUPED_MM_DEVICES:
        return
    if not _GROUPED_MM_LIB:
        _GROUPED_MM_LIB.append(torch.library.Library("aten", "IMPL"))

    def kernel(
        mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None
    ) -> Any:
        dtype = torch.get_autocast_dtype(device_type)

        def cast(t: Any) -> Any:
            return t.to(dtype) if t is not None and t.is_floating_point() else t

        with torch.autocast(device_type, enabled=False):  # the op itself, not this rule again
            return torch.ops.aten._grouped_mm(cast(mat_a), cast(mat_b), offs, cast(bias), out_dtype)

    _GROUPED_MM_LIB[0].impl("_grouped_mm", kernel, key)
    _GROUPED_MM_DEVICES.add(device_type)
    log.info(
        "autocast: the grouped expert matmul (aten::_grouped_mm) computes in the autocast dtype "
        "on %s, as the other matmuls do",
        device_type,
    )


def build_grad_scaler(cfg: ParallelConfig, device: torch.device) -> ShardedGradScaler | None:
    """The loss scaler an fp16 run needs (None for fp32/bf16: their exponent range is fp32's).
    ShardedGradScaler, not torch.amp.GradScaler: the same algorithm plus the all-reduce of the
    infinity flag, which sharded gradients need and replicated ones do not mind."""
    if cfg.param_dtype != "float16":
        return None
    from meshrun.parallel.scaler import MeshGradScaler

    return MeshGradScaler(device=device.type)
