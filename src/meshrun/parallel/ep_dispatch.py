"""The expert-parallel exchange of one MoE layer: dispatch tokens to the ranks that hold their
experts with ``all_to_all``, run the layer's own expert computation there, combine the results
back on the sender.

An MoE layer is a router (the model's own: top-k, normalisation, aux loss unchanged) and an
*expert container*: a module called as ``experts(hidden [N, H], top_k_index [N, K],
top_k_weights [N, K]) -> [N, H]`` that returns ``sum_k w[n, k] * expert_{idx[n, k]}(hidden[n])``.
Every transformers-5 MoE family (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3, ...) has one; a
user's own MoE declares it (``ModelSpec(experts=...)``).

Rank ``e`` of an ep group of size ``ep`` keeps experts ``[e * E/ep, (e + 1) * E/ep)``. Its
forward sorts the (token, slot) pairs by expert (so by owner, then by local expert), exchanges
the split sizes, sends the rows to their owners, runs the container's *own* forward there on
local expert ids with unit weights (eager, grouped_mm or a user's kernel keep working),
sends the results back, then weights and sums per token on the sender, where the router's
gradient is. The backward of the dispatch brings every ep rank's gradient to the expert's
owner: after backward an expert gradient is the sum over its ep group (parallel/ep.py divides).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ExpertsForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class EPLayer:
    """One sharded container: its group, sizes, original forward, and the tokens per expert
    this rank routed since the last read (for the metrics)."""

    name: str
    group: dist.ProcessGroup
    ep_size: int
    num_experts: int
    local_forward: ExpertsForward
    counts: torch.Tensor  # [E] int64, (token, slot) pairs routed to each global expert
    on_backward: Callable[[], None] | None = None  # hooked into the combine's backward
    list_names: list[str] = field(default_factory=list)  # ModuleLists of experts (global ids)
    tensor_names: list[str] = field(default_factory=list)  # fused [E, ...] tensors, split on dim
    dim: int = 0

    @property
    def n_local(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0 whose backward is the reverse exchange (public API
    only: torch.distributed.nn's is deprecated, the functional collectives' one is private)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        out_sizes: list[int],
        in_sizes: list[int],
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        out = x.new_empty((sum(out_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_sizes, in_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_sizes, in_sizes = ctx.sizes
        grad_in = grad.new_empty((sum(in_sizes), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_sizes, out_sizes, group=ctx.group)
        return grad_in, None, None, None


def ep_forward(
    state: EPLayer, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The container's forward under expert parallel (module docstring)."""
    n_tokens, top_k = top_k_index.shape
    ep, n_local = state.ep_size, state.n_local
    flat = top_k_index.reshape(-1)
    # Stable: equal expert ids keep token order, so the result is deterministic.
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=state.num_experts)
    state.counts += counts.detach()
    send_counts = counts.view(ep, n_local)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=state.group)  # the uneven splits
    send_sizes = send_counts.sum(dim=1).tolist()  # all_to_all takes its sizes on the host
    recv_sizes = recv_counts.sum(dim=1).tolist()
    received = _AllToAll.apply(hidden[order // top_k], recv_sizes, send_sizes, state.group)
    # Rows arrive by source rank, then by local expert: their local ids from the counts.
    local_ids = torch.arange(n_local, device=hidden.device).repeat(ep)
    local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1))
    if received.shape[0] > 0:
        # The container's own computation, top-1 with weight 1 (exact: x * 1.0 == x).
        ones = received.new_ones((received.shape[0], 1))
        out = state.local_forward(received, local_ids[:, None], ones)
    else:
        # Nothing to compute here, but the combine's backward must still run on this rank (the
        # peers wait for it): keep the empty result attached to the graph.
        out = received * 0.0
    back = _AllToAll.apply(out, send_sizes, recv_sizes, state.group)
    if back.requires_grad and state.on_backward is not None:
        hook = state.on_backward
        back.register_hook(lambda grad: (hook(), grad)[1])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_slot = back[inverse].view(n_tokens, top_k, -1)
    # Weighted on the sender (the router's gradient stays local), summed over the slots in
    # slot order as transformers' grouped_mm and batched_mm implementations do.
    return (per_slot * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden.dtype)


def expert_tensors(mod: nn.Module, n_exp: int, dim: int) -> list[str]:
    """The container's own parameters and buffers with ``n_exp`` experts on ``dim``."""
    own = [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
    return [n for n, t in own if t.dim() > dim and t.shape[dim] == n_exp]


def expert_lists(mod: nn.Module, n_exp: int) -> list[str]:
    """The container's child ``nn.ModuleList``s of ``n_exp`` experts."""
    return [n for n, c in mod.named_children() if isinstance(c, nn.ModuleList) and len(c) == n_exp]


def shard_container(
    name: str,
    mod: nn.Module,
    group: dist.ProcessGroup,
    n_exp: int,
    dim: int,
    num_experts_attr: str,
) -> EPLayer:
    """Keep this rank's ``E/ep`` experts of ``mod`` (checked by the caller) and route its
    forward through :func:`ep_forward`."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    lo, hi = rank * (n_exp // ep), (rank + 1) * (n_exp // ep)
    device = next(iter(mod.parameters()), torch.empty(0)).device
    counts = torch.zeros(n_exp, dtype=torch.long, device=device)
    state = EPLayer(name, group, ep, n_exp, mod.forward, counts, dim=dim)
    state.tensor_names = expert_tensors(mod, n_exp, dim)
    for tname in state.tensor_names:
        t = getattr(mod, tname)
        local = t.detach().narrow(dim, lo, hi - lo).clone()
        if isinstance(t, nn.Parameter):
            setattr(mod, tname, nn.Parameter(local, requires_grad=t.requires_grad))
        else:
            mod._buffers[tname] = local
    for lname in expert_lists(mod, n_exp):
        setattr(mod, lname, nn.ModuleList(list(getattr(mod, lname))[lo:hi]))
        state.list_names.append(lname)
    setattr(mod, num_experts_attr, n_exp // ep)
    mod.__dict__["_meshrun_ep"] = state  # not a submodule: survives FSDP2 and DDP
    # The instance attribute shadows the class's forward; local_forward is the original.
    mod.forward = lambda h, idx, w, _s=state: ep_forward(_s, h, idx, w)
    return state


def ep_state(mod: nn.Module) -> EPLayer | None:
    """The expert-parallel state of a sharded container, else None."""
    state = mod.__dict__.get("_meshrun_ep")
    return state if isinstance(state, EPLayer) else None


def ep_containers(model: nn.Module) -> list[tuple[nn.Module, EPLayer]]:
    """Every sharded container of ``model`` with its state, in module order."""
    return [(m, s) for m in model.modules() if (s := ep_state(m)) is not None]


def tokens_per_expert(
    model: nn.Module, group: dist.ProcessGroup | None, reset: bool = True
) -> dict[str, list[int]]:
    """Per MoE layer, the (token, slot) pairs routed to each of its E experts since the last
    reset, summed over ``group`` (the data-parallel ranks: the whole batch). One all_reduce."""
    layers = [s for _, s in ep_containers(model)]
    if not layers:
        return {}
    stacked = torch.stack([s.counts for s in layers])
    if group is not None:
        dist.all_reduce(stacked, group=group)
    if reset:
        for s in layers:
            s.counts.zero_()
    return {s.name: row.tolist() for s, row in zip(layers, stacked, strict=True)}


def imbalance(counts: list[int]) -> float:
    """max / mean tokens per expert (1.0 = perfectly balanced), the usual MoE figure."""
    mean = sum(counts) / max(len(counts), 1)
    return max(counts) / mean if mean > 0 else 1.0
