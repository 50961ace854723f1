"""Gradient helpers that are correct under every layout: the accumulation switch, and the norm
of the whole gradient and its clip, the same number under every layout.

Why float64: torch's fp32 norm on CPU sums the squares one by one; over a vocabulary-sized
gradient it is off by 2.2e-5 relative at 1e6 elements and 1.4e-4 at 4e6 (measured with torch
2.13), and a sharded layout sums other pieces, so it loses a different amount. The clip
coefficient then differs by layout, and so does every later step (issue 27 measured 5.4e-4 on
ZeRO-3). Here each rank sums the squares of its *local* gradient tensors in float64 (in chunks,
so the float64 copy stays small), the sums are added over the mesh dims that *shard* each
gradient (never over the replicated ones: a replicated copy counted twice would be wrong),
then over the pipeline stages, and the coefficient ``min(1, max_norm / (norm + 1e-6))`` is one
float64 number, applied to each gradient in its own dtype. Placements: ``Shard`` (FSDP2, TP,
HSDP's shard dim) and FSDP2's strided shard over a TP shard count as sharding; ``Replicate``
(HSDP's replicate dim, DDP-style replication of a stage) does not; a ``Partial`` gradient is
reduced first; an expert parameter (``parallel.ep``) is also cut over its ep group. A pipeline's second copy of a tied parameter (parallel/pp/tied.py) is counted
once, as one process counts the one tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.parallel.ep import set_ep_grad_sync
from meshrun.parallel.kinds import is_dtensor, is_fsdp_module

# Elements per float64 chunk of a large gradient: a 2**24-element piece costs 128 MiB in
# float64, whatever the size of the embedding it comes from.
CHUNK = 1 << 24
EPS = 1e-6  # torch's clip_grad_norm_ adds it too: a zero gradient gives coefficient max_norm/eps


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient reduction on non-boundary micro-steps: what ``DDP.no_sync()`` does, as
    a switch (set before the forward, so the step loop sets it before each micro-batch). Under
    FSDP2 the same switch is ``set_requires_gradient_sync``: gradients accumulate unsharded
    and are reduce-scattered once, on the boundary micro-step."""
    set_ep_grad_sync(model, enabled)
    if isinstance(model, DDP):
        model.require_backward_grad_sync = enabled
    elif is_fsdp_module(model):
        model.set_requires_gradient_sync(enabled)


@dataclass
class _Part:
    """Local gradient tensors that are cut alike: the groups of the mesh dims that shard them
    and into how many distinct pieces those dims cut each gradient."""

    groups: tuple[dist.ProcessGroup, ...]
    pieces: int
    tensors: list[Tensor] = field(default_factory=list)


def _parts(params: Sequence[torch.Tensor]) -> list[_Part]:
    """This rank's gradients by sharding, in the parameters' order (so every rank of a group
    issues the same collectives in the same order). A parameter without a gradient still adds
    its sharding: the collectives do not depend on which gradients happen to exist."""
    parts: dict[tuple[dist.ProcessGroup, ...], _Part] = {}
    for p in params:
        if _replica(p):
            continue
        groups, pieces, local = _local_grad(p)
        part = parts.setdefault(groups, _Part(groups, pieces))
        if local is not None:
            part.tensors.append(local)
    return list(parts.values())


def _local_grad(p: torch.Tensor) -> tuple[tuple[dist.ProcessGroup, ...], int, Tensor | None]:
    """(groups of the sharding dims, pieces, local gradient) of one parameter. An expert
    parameter (parallel/ep.py) is also cut over its ep group: each ep rank holds other
    experts."""
    groups, pieces, local = _mesh_grad(p)
    ep_group = getattr(p, "meshrun_ep_group", None)
    if ep_group is None:
        return groups, pieces, local
    return (*groups, ep_group), pieces * dist.get_world_size(ep_group), local


def _mesh_grad(p: torch.Tensor) -> tuple[tuple[dist.ProcessGroup, ...], int, Tensor | None]:
    """(groups of the sharding mesh dims, pieces, local gradient) of one parameter. A plain
    alias of a DTensor parameter (a pipeline under ZeRO-1, ``meshrun_view_of``) is cut like
    it."""
    grad, src = p.grad, getattr(p, "meshrun_view_of", p)
    spec = grad if is_dtensor(grad) else src if is_dtensor(src) else None
    if spec is None:
        return (), 1, grad
    from torch.distributed.tensor import Partial, Replicate, Shard

    shards: tuple[type, ...] = (Shard,)
    try:  # FSDP2's shard of a TP shard; a private class (not a Shard subclass in torch 2.13)
        from torch.distributed.tensor.placement_types import _StridedShard

        shards = (Shard, _StridedShard)
    except ImportError:
        pass
    if is_dtensor(grad) and any(isinstance(pl, Partial) for pl in grad.placements):
        # Partial sums per rank: their squares do not add up. Reduce them (rare: a collective).
        full = [Replicate() if isinstance(pl, Partial) else pl for pl in grad.placements]
        grad = spec = grad.redistribute(grad.device_mesh, full)
    dims = []
    for i, pl in enumerate(spec.placements):
        if isinstance(pl, shards):
            dims.append(i)
        elif not isinstance(pl, Replicate):
            raise ValueError(
                f"gradient norm: placement {pl!r} of a {tuple(spec.shape)} gradient is neither "
                "Shard, Replicate nor Partial; meshrun cannot tell which ranks hold which part"
            )
    mesh = spec.device_mesh
    pieces = math.prod(mesh.size(i) for i in dims)
    local = None if grad is None else (grad.to_local() if is_dtensor(grad) else grad)
    return tuple(mesh.get_group(i) for i in dims), pieces, local


def _replica(p: torch.Tensor) -> bool:
    src = getattr(p, "meshrun_view_of", p)
    return bool(
        getattr(p, "meshrun_tied_replica", False) or getattr(src, "meshrun_tied_replica", False)
    )


def _power_sum(tensors: Sequence[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """sum |x|^p (max |x| for inf) over ``tensors``, in float64 on ``device``."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    by_device: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        pieces = (t,) if t.numel() <= CHUNK else t.detach().reshape(-1).split(CHUNK)
        by_device.setdefault(t.device, []).extend(pieces)
    for chunks in by_device.values():
        norms = torch.stack(torch._foreach_norm(chunks, norm_type, dtype=torch.float64))
        part = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
        part = part.to(device)
        total = torch.maximum(total, part) if math.isinf(norm_type) else total + part
    return total


def _device(params: Sequence[torch.Tensor]) -> torch.device:
    for p in params:
        if p.grad is not None:
            return p.grad.device
    return params[0].device if params else torch.device("cpu")


@torch.no_grad()
def grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> float:
    """The ``norm_type``-norm of the whole gradient, as one process computes it on the same
    global batch in float64 (see the module docstring). Collective over the groups that shard
    the gradients and ``pp_group`` (the pipeline stages): every rank of them must call it."""
    params = list(parameters)
    p, device = float(norm_type), _device(params)
    inf = math.isinf(p)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = torch.zeros((), dtype=torch.float64, device=device)
    for part in _parts(params):
        s = _power_sum(part.tensors, p, device)
        for group in part.groups:  # one dim after the other: the sum over all the pieces
            dist.all_reduce(s, op=op, group=group)
        total = torch.maximum(total, s) if inf else total + s
    if pp_group is not None:
        dist.all_reduce(total, op=op, group=pp_group)
    return float(total) if inf else float(total) ** (1.0 / p)


@torch.no_grad()
def grad_sq_share(parameters: Iterable[torch.Tensor], holders: int) -> float:
    """This rank's share of the squared 2-norm of the whole gradient, such that the *sum of the
    shares over all ranks* is the square of :func:`grad_norm` (the step loop adds them up in
    its per-step agreement, a collective it runs anyway). ``holders``: how many ranks hold each
    parameter (the world, or the world / pp under pipeline parallel): each rank's sum of
    squares of a sharding counts ``pieces / holders``, so each distinct piece counts once. No
    collective (unless a gradient is ``Partial``)."""
    params = list(parameters)
    device = _device(params)
    share = 0.0
    for part in _parts(params):
        share += float(_power_sum(part.tensors, 2.0, device)) * part.pieces / holders
    return share


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """``min(1, max_norm / (total_norm + 1e-6))``, in float64 (NaN for a NaN norm)."""
    coef = max_norm / (total_norm + EPS)
    return coef if math.isnan(coef) else min(1.0, coef)


@torch.no_grad()
def clip_grads_(parameters: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale every gradient by :func:`clip_coefficient` in its own dtype (nothing to do at 1);
    returns the coefficient. Local: each rank scales its own pieces."""
    coef = clip_coefficient(max_norm, total_norm)
    if coef == 1.0:
        return coef
    kinds: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            local = p.grad.to_local() if is_dtensor(p.grad) else p.grad
            kinds.setdefault((local.device, local.dtype), []).append(local)
    for tensors in kinds.values():
        torch._foreach_mul_(tensors, coef)
    return coef


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip to ``max_norm`` by the norm of the *whole* gradient, and return that norm (a
    float64 scalar): the same number, and so the same coefficient, under every layout (sharded
    DTensor gradients of FSDP2 / TP, plain ones of DDP, ``pp_group`` summing the stages). See
    :func:`grad_norm`; collective over the same groups."""
    params = list(parameters)
    total = grad_norm(params, norm_type, pp_group)
    clip_grads_(params, max_norm, total)
    return torch.tensor(total, dtype=torch.float64)
