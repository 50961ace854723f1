"""Gradient helpers that are correct under every layout: the accumulation switch and the global
gradient-norm clip over sharded (DTensor) gradients."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.parallel.kinds import is_dtensor, is_fsdp_module


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient reduction on non-boundary micro-steps: what ``DDP.no_sync()`` does, as
    a switch (set before the forward, so the step loop sets it before each micro-batch). Under
    FSDP2 the same switch is ``set_requires_gradient_sync``: gradients accumulate unsharded
    and are reduce-scattered once, on the boundary micro-step."""
    if isinstance(model, DDP):
        model.require_backward_grad_sync = enabled
    elif is_fsdp_module(model):
        model.set_requires_gradient_sync(enabled)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip to ``max_norm`` by the norm of the *whole* gradient, and return that norm.

    Sharded gradients (FSDP2, tensor parallel) are DTensors: their norm is a partial value per
    rank, and ``full_tensor()`` reduces it over the mesh, so every rank clips by the same global
    norm: the norm one process would compute on the same global batch. Under pipeline
    parallelism each stage holds other parameters: ``pp_group`` sums the stages' p-th powers.
    """
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in parameters:  # foreach kernels take one kind of tensor: group by mesh (None: plain)
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if not by_mesh and pp_group is None:
        return torch.tensor(0.0)
    # A pipeline's second copy of a tied parameter (parallel/pp_tied.py) holds the same gradient
    # as the first: counted once, as one process counts the one tensor.
    norms = [
        _full(
            torch.nn.utils.get_total_norm(
                [p.grad for p in ps if p.grad is not None and not _replica(p)], norm_type
            )
        )
        for ps in by_mesh.values()
    ]
    total = torch.nn.utils.get_total_norm(norms, norm_type) if norms else torch.tensor(0.0)
    if pp_group is not None:
        total = total**norm_type
        dist.all_reduce(total, group=pp_group)
        total = total ** (1.0 / norm_type)
    for ps in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)  # reads each p.grad
    return total


def _replica(p: torch.Tensor) -> bool:
    return bool(getattr(p, "meshrun_tied_replica", False))


def _full(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if is_dtensor(norm) else norm
