"""The fp16 loss scaler of every layout (``build_grad_scaler`` in precision.py imports it, so
FSDP's scaler is imported only by a run that scales its loss)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


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
