"""Expert parallel (``parallel.ep``): the experts of each MoE layer split over groups of ``ep``
consecutive data-parallel ranks, tokens exchanged with ``all_to_all`` (parallel/ep_dispatch.py).

Where the experts are comes from what the model declares: a Hugging Face transformers-5 MoE
model names its expert container in ``config.base_model_ep_plan`` (``"ep_dispatch_experts"``);
a user's own MoE passes ``ModelSpec(experts=...)``. Anything else is refused before step 1,
with the reason.

Gradients: the ep ranks are data-parallel ranks (each its own batch; the loss is the mean over
the D data-parallel ranks). The dispatch's backward already sums an expert's gradient over its
ep group, so the expert gradients are summed over the ``ep_replicate`` group (the D / ep ranks
holding the same experts) and divided by D; the dense ones are averaged by DDP / FSDP2 as
usual. Under FSDP2 (zero 2/3) each container is its own FSDP unit over ``ep_replicate`` with
gradient divide factor D; under DDP the experts are left out of DDP and reduced once at the end
of the backward (:func:`_reduce_expert_grads`). The gradient norm (parallel/grads.py) sums the
experts' squares over the ep group too (``meshrun_ep_group`` on each expert parameter).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.config import ConfigError
from meshrun.parallel.ep_dispatch import (
    EPLayer,
    ep_containers,
    expert_lists,
    expert_tensors,
    shard_container,
)
from meshrun.parallel.structure import ExpertsDecl, ModelSpec, matching_modules

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

EP_PLAN_ENTRY = "ep_dispatch_experts"  # transformers' base_model_ep_plan value for a container


@dataclass
class EPLayout:
    """What :func:`apply_ep` did, for the data-parallel step and the gradient reduction."""

    mesh: DeviceMesh  # (pp, ep, ep_replicate, tp): runtime/mesh.py build_ep_mesh
    dp: int  # D: every data-parallel rank, the ep ones included
    source: str  # where the declaration came from (for the start-up line)
    containers: list[str] = field(default_factory=list)
    dp_group: dist.ProcessGroup | None = None  # every dp rank: tokens per expert of the batch
    params: list[nn.Parameter] = field(default_factory=list)  # the experts' (DDP path)
    sync: bool = True  # the accumulation switch (parallel/grads.py set_grad_sync)
    queued: bool = False

    @property
    def ep(self) -> int:
        return self.mesh["ep"].size()

    @property
    def replicas(self) -> int:
        return self.mesh["ep_replicate"].size()


def find_experts(model: nn.Module, spec: ModelSpec | None) -> tuple[ExpertsDecl | None, str]:
    """The expert declaration: ``spec.experts`` first, then the model's own
    ``config.base_model_ep_plan`` (under ``base_model_prefix`` for a ``*ForCausalLM``)."""
    if spec is not None and spec.experts is not None:
        decl = spec.experts
        return (ExpertsDecl(decl) if isinstance(decl, str) else decl), "ModelSpec.experts"
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None)
    if not isinstance(plan, Mapping):
        return None, ""
    entries = [k for k, v in plan.items() if v == EP_PLAN_ENTRY]
    if len(entries) != 1:
        return None, ""
    prefix = getattr(model, "base_model_prefix", "")
    has_base = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    pattern = f"{prefix}.{entries[0]}" if has_base else entries[0]
    return ExpertsDecl(pattern), "config.base_model_ep_plan"


def _refuse(ep: int, what: str) -> ConfigError:
    return ConfigError(f"parallel.ep = {ep}: {what}; or set parallel.ep=1")


def _check_container(name: str, mod: nn.Module, decl: ExpertsDecl, ep: int) -> int:
    """E of one container, or the reason it cannot be split (nothing has changed yet)."""
    n_exp = getattr(mod, decl.num_experts_attr, None)
    if not isinstance(n_exp, int) or isinstance(n_exp, bool):
        raise _refuse(
            ep,
            f"the expert container {name} ({type(mod).__name__}) has no int attribute "
            f"{decl.num_experts_attr!r} holding its number of experts; pass ModelSpec(experts="
            "ExpertsDecl(pattern, num_experts_attr=...))",
        )
    if n_exp % ep:
        ok = [d for d in range(1, n_exp + 1) if n_exp % d == 0]
        raise _refuse(
            ep, f"{name} has {n_exp} experts, which do not divide by ep; choose ep in {ok}"
        )
    tensors, lists = expert_tensors(mod, n_exp, decl.expert_dim), expert_lists(mod, n_exp)
    if not tensors and not lists:
        raise _refuse(
            ep,
            f"{name} has no parameter with {n_exp} experts on dim {decl.expert_dim} and no "
            f"nn.ModuleList of {n_exp} experts: meshrun cannot tell which tensors to split",
        )
    kept = {f"{n}." for n in lists}
    other = [
        n
        for n, _ in mod.named_parameters()
        if n not in tensors and not any(n.startswith(k) for k in kept)
    ]
    if other:
        raise _refuse(
            ep,
            f"{name} holds parameters that belong to no expert ({other[:4]}): each ep rank "
            "would train its own copy; move them out of the expert container",
        )
    return n_exp


def apply_ep(
    model: nn.Module, ep_mesh: DeviceMesh, dp: int, spec: ModelSpec | None = None
) -> EPLayout:
    """Keep this rank's ``E / ep`` experts of every declared container and dispatch tokens
    over ``ep_mesh["ep"]``. Every check runs before anything changes (ConfigError). All ranks
    must hold identical weights before the call (meshrun seeds them alike)."""
    ep = ep_mesh["ep"].size()
    decl, source = find_experts(model, spec)
    if decl is None:
        raise _refuse(
            ep,
            f"{type(model).__name__} declares no mixture-of-experts layers (no "
            f"config.base_model_ep_plan entry {EP_PLAN_ENTRY!r}); for your own MoE pass "
            "run.parallelize(model, spec=ModelSpec(experts='path.*.experts'))",
        )
    if any(p.is_meta for p in model.parameters()):
        raise _refuse(ep, "the model is on the meta device; build it on a real device")
    found = {n: m for n, m in model.named_modules() if fnmatch.fnmatchcase(n, decl.pattern)}
    if not found:
        raise _refuse(
            ep,
            f"no module of {type(model).__name__} matches the experts pattern "
            f"{decl.pattern!r} (from {source})",
        )
    sizes = {n: _check_container(n, m, decl, ep) for n, m in found.items()}
    layout = EPLayout(ep_mesh, dp, source, list(found))
    group = ep_mesh["ep"].get_group()
    for name, mod in found.items():
        shard_container(name, mod, group, sizes[name], decl.expert_dim, decl.num_experts_attr)
    return layout


def describe_ep(model: nn.Module, layout: EPLayout) -> str:
    """The start-up line: how many layers, experts per rank, groups."""
    layers = [s for _, s in ep_containers(model)]
    first = layers[0]
    return (
        f"expert parallel over {layout.ep} ranks: {len(layers)} MoE layers ({layout.source}), "
        f"{first.n_local} of {first.num_experts} experts per rank, gradients summed over "
        f"{layout.replicas} replica(s) / {layout.dp}"
    )


def without_experts(model: nn.Module, plan: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A tensor-parallel plan less its rules for the expert containers and their tensors: under
    ``ep`` the experts are split by expert, not by column (HF's ``packed_colwise``, ...)."""
    if plan is None:
        return None
    names = [n for m, _ in ep_containers(model) for n, x in model.named_modules() if x is m]
    inside = tuple(names) + tuple(f"{n}." for n in names)
    return {
        pattern: style
        for pattern, style in plan.items()
        if not any(m.startswith(inside) for m in matching_modules(model, {pattern: style}))
    }


def expert_names(model: nn.Module) -> list[str]:
    """FQNs (in ``model``) of the expert containers' parameters and buffers: DDP leaves them
    alone."""
    out = []
    for prefix, mod in model.named_modules():
        if mod.__dict__.get("_meshrun_ep") is not None:
            own = [*mod.named_parameters(), *mod.named_buffers()]
            out += [f"{prefix}.{n}" if prefix else n for n, _ in own]
    return out


def prepare_ddp(model: nn.Module, layout: EPLayout) -> None:
    """Before DDP wraps ``model``: DDP must neither all-reduce the experts' gradients over all
    dp ranks nor broadcast rank 0's experts; they are reduced at the end of each backward."""
    DDP._set_params_and_buffers_to_ignore_for_model(model, expert_names(model))
    layout.params = [p for m, _ in ep_containers(model) for p in m.parameters()]
    for _, state in ep_containers(model):
        state.on_backward = lambda: _queue_reduce(layout)


def _queue_reduce(layout: EPLayout) -> None:
    """Called from the combine's backward: reduce the expert gradients once, when the whole
    backward is done (the engine's callback, as DDP's reducer finalises), on a sync step."""
    if layout.sync and not layout.queued:
        layout.queued = True
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: _reduce_expert_grads(layout)
        )


@torch.no_grad()
def _reduce_expert_grads(layout: EPLayout) -> None:
    """Sum over the replicas, divide by D. A missing gradient (an expert no token reached on
    this rank) counts as zero, so every rank issues the same collective."""
    layout.queued = False
    grads = []
    for p in layout.params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one collective, not one per tensor
    if layout.replicas > 1:
        dist.all_reduce(flat, group=layout.mesh["ep_replicate"].get_group())
    flat.div_(layout.dp)
    torch._foreach_copy_(
        grads,
        [t.view_as(g) for t, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)],
    )


def apply_ep_fsdp(
    model: nn.Module, layout: EPLayout, zero: int, mp_policy: MixedPrecisionPolicy | None
) -> None:
    """ZeRO 2/3: each container its own FSDP2 unit over ``ep_replicate``, before the blocks'
    units, with gradient divide factor D (the gradient is the sum over the ep group)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rep = layout.mesh["ep_replicate"]
    gloo = dist.get_backend(rep.get_group()) == "gloo"
    for mod, _ in ep_containers(model):
        fully_shard(
            mod,
            mesh=rep,
            reshard_after_forward=zero == 3,
            mp_policy=mp_policy or MixedPrecisionPolicy(),
        )
        mod.set_gradient_divide_factor(float(layout.dp))  # type: ignore[operator]
        if gloo and rep.size() > 1:
            # Gloo has no PREMUL_SUM: sum, then divide. Not on a 1-rank mesh: there torch 2.13
            # divides by the factor and then again (gradients / D**2, measured).
            mod.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


def mark_expert_params(model: nn.Module) -> None:
    """After DDP / FSDP2: tag each expert parameter with its ep group, so the gradient norm
    adds the squares of the other ep ranks' experts (parallel/grads.py)."""
    for mod, state in ep_containers(model):
        for p in mod.parameters():
            p.meshrun_ep_group = state.group  # type: ignore[attr-defined]


def user_module(model: nn.Module) -> nn.Module:
    """The user's module inside DDP's wrapper (a user's own ``.module`` attribute is not one)."""
    return model.module if isinstance(model, DDP) else model


def layout_of(model: nn.Module) -> EPLayout | None:
    """The expert-parallel layout of a parallelized model (or its DDP wrapper)."""
    found = user_module(model).__dict__.get("_meshrun_ep_layout")
    return found if isinstance(found, EPLayout) else None


def set_ep_grad_sync(model: nn.Module, enabled: bool) -> None:
    """The accumulation switch for the DDP path's expert reduction (FSDP2's is its own)."""
    layout = layout_of(model)
    if layout is not None:
        layout.sync = enabled


__all__ = [
    "EPLayer",
    "EPLayout",
    "apply_ep",
    "apply_ep_fsdp",
    "describe_ep",
    "find_experts",
    "full_state_dict",
    "layout_of",
    "mark_expert_params",
    "prepare_ddp",
    "set_ep_grad_sync",
    "without_experts",
]


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2 over the replicas, TP) as its full value on this rank; else ``t``."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def global_name(rel: str, state: EPLayer, rank: int) -> str | None:
    """The name, as one process has it, of the container tensor ``rel`` held by ep rank
    ``rank``: ``experts.<i>.w`` of a ModuleList is at global index ``rank * E/ep + i``; None
    for a fused ``[E/ep, ...]`` tensor (it keeps its name, split on ``state.dim``)."""
    head, _, tail = rel.partition(".")
    if head not in state.list_names:
        return None
    i, _, rest = tail.partition(".")
    return f"{head}.{rank * state.n_local + int(i)}.{rest}"


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s whole state dict as one process holds it: every expert gathered over its ep
    group under its global name and index, DTensors whole. Collective (every rank calls it);
    for a ``--hf`` export or a comparison with one process."""
    inner = user_module(model)
    out = {k: _whole(v).detach().clone() for k, v in inner.state_dict().items()}
    for prefix, mod in inner.named_modules():
        state = mod.__dict__.get("_meshrun_ep")
        if not isinstance(state, EPLayer):
            continue
        for rel, t in [*mod.named_parameters(), *mod.named_buffers()]:
            if rel not in state.tensor_names and rel.partition(".")[0] not in state.list_names:
                continue  # not split: the same on every ep rank
            local = _whole(t.detach()).contiguous()
            parts = [torch.empty_like(local) for _ in range(state.ep_size)]
            dist.all_gather(parts, local, group=state.group)
            if global_name(rel, state, 0) is None:
                out[f"{prefix}.{rel}"] = torch.cat(parts, dim=state.dim)
                continue
            del out[f"{prefix}.{rel}"]
            for r, part in enumerate(parts):
                out[f"{prefix}.{global_name(rel, state, r)}"] = part
    return out
