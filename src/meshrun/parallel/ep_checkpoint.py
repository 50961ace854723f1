"""Checkpoints of an expert-parallel model that resume at another ``ep`` (or none).

DCP's ``get_state_dict`` gives each rank its own experts under local names and shapes. Before
a save (and a load) :func:`ep_state_views` rewrites them as one process would name them: a
fused ``[E/ep, ...]`` expert tensor (and its optimizer state) becomes a DTensor view over the
``(ep, ep_replicate)`` mesh, ``Shard`` on the expert dim over ``ep`` (then FSDP2's own shard,
or ``Replicate``, over ``ep_replicate``) with the global shape ``[E, ...]``; a ``ModuleList``
expert's tensors keep their values under the global index. The views share storage with the
model's and optimizer's tensors, so DCP's in-place load writes into them and another ep size
(or one process) reads the same keys and offsets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from meshrun.parallel.ep import EPLayout, global_name, layout_of, user_module
from meshrun.parallel.ep_dispatch import EPLayer, ep_state
from meshrun.parallel.kinds import is_dtensor

# Wrapper names DCP leaves out of an FQN (activation checkpointing, torch.compile).
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _clean(name: str) -> str:
    for w in WRAPPERS:
        name = name.replace(w, "")
    return name


def _expert_keys(model: nn.Module) -> tuple[dict[str, str], dict[str, EPLayer]]:
    """(local FQN -> global FQN of ModuleList experts, FQN -> layer of fused tensors)."""
    inner = user_module(model)
    renames: dict[str, str] = {}
    fused: dict[str, EPLayer] = {}
    for prefix, mod in inner.named_modules():
        state = ep_state(mod)
        if state is None:
            continue
        base = _clean(f"{prefix}." if prefix else "")
        for rel, _ in [*mod.named_parameters(), *mod.named_buffers()]:
            rel = _clean(rel)
            name = global_name(rel, state, state.rank)
            if name is not None:
                renames[base + rel] = base + name
            elif rel in state.tensor_names:
                fused[base + rel] = state
    return renames, fused


def _global_view(value: torch.Tensor, state: EPLayer, layout: EPLayout) -> torch.Tensor:
    """A DTensor over ``(ep, ep_replicate)`` with the global shape, sharing ``value``'s
    storage (a plain tensor: replicated over the replicas; FSDP2's: sharded as it is)."""
    from torch.distributed.tensor import DTensor, Replicate

    if is_dtensor(value):
        local, inner = value.to_local(), value.placements[0]
    else:
        local, inner = value, Replicate()
    from torch.distributed.tensor import Shard

    shape = list(value.shape)
    shape[state.dim] *= state.ep_size
    size = torch.Size(shape)
    return DTensor.from_local(
        local,
        layout.mesh["ep", "ep_replicate"],
        [Shard(state.dim), inner],
        run_check=False,
        shape=size,
        stride=torch.empty(size, device="meta").stride(),
    )


def ep_state_views(
    model: nn.Module, msd: dict[str, Any], osd: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and optimizer state dicts (DCP's ``get_state_dict``) with every expert tensor
    as one process names it (module docstring); the same dicts without expert parallel."""
    layout = layout_of(model)
    if layout is None:
        return msd, osd
    renames, fused = _expert_keys(model)

    def convert(key: str, value: Any, like: Any) -> Any:
        state = fused.get(key)
        same = isinstance(value, torch.Tensor) and value.shape == like.shape
        return _global_view(value, state, layout) if state is not None and same else value

    new_msd = {renames.get(k, k): convert(k, v, v) for k, v in msd.items()}
    states = osd.get("state", {})
    new_states = {
        renames.get(k, k): {n: convert(k, v, msd[k]) if k in msd else v for n, v in entry.items()}
        for k, entry in states.items()
    }
    return new_msd, {**osd, "state": new_states}


def ep_loaded(
    msd: dict[str, Any], osd: dict[str, Any], loaded: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """After DCP loaded into the views: the model and optimizer state dicts under this rank's
    own names (their tensors hold the loaded values: the views share storage), with the
    saved optimizer hyperparameters and this rank's parameter names in each group."""
    groups = [
        {**saved, "params": own["params"]}
        for own, saved in zip(osd["param_groups"], loaded["param_groups"], strict=True)
    ]
    return msd, {"state": osd["state"], "param_groups": groups}
