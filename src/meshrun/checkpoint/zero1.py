"""ZeRO-1 (``ZeroRedundancyOptimizer``) state in the same checkpoint format as any other layout.

Why not ``zero.state_dict()``: it needs ``consolidate_state_dict(to=0)`` first, which sends
every rank's optimizer state to rank 0 (all of it in one process's memory) and keys it by
parameter index. DCP's ``get_state_dict`` does not know ZeRO at all.

What is done instead: every parameter's optimizer state lives, whole, on exactly one rank (its
owner in ZeRO's partition). Each rank gives DCP the entries it owns, keyed by the parameter's
FQN exactly as ``get_state_dict`` keys a plain optimizer (``optim.state.<fqn>.<key>``), and DCP
writes each entry from its owner only. The checkpoint is therefore the same as a DDP run's:
it resumes under ZeRO-1 on any number of ranks (each rank loads only what it now owns), under
DDP, FSDP2 or on one process, and a DDP/FSDP2 checkpoint resumes under ZeRO-1. Non-tensor
per-parameter values (rare) are gathered to rank 0's JSON with one small all-gather.

Under pipeline parallelism ZeRO steps plain aliases of the stage parameters (marked
``meshrun_view_of``, see ``Pipeline.local_parameters``), named here by the parameter they alias;
each rank's param groups name only its stages' parameters, so the Checkpointer joins them over the
stages (``gather_optim_plain``) and each rank loads back its own (``partial``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

from meshrun.checkpoint.state import split_state
from meshrun.parallel.kinds import is_zero_redundancy

# DCP and torch.distributed.optim are imported where a save or a resume first needs them: a run
# without ZeRO-1 or checkpoints never imports them.
if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["is_zero1", "zero1_load", "zero1_load_template", "zero1_state_dict"]

PREFIX = "optim.state."


def is_zero1(optimizer: torch.optim.Optimizer) -> TypeGuard[ZeroRedundancyOptimizer]:
    return is_zero_redundancy(optimizer)


def _id(p: torch.Tensor) -> int:
    """The id a parameter is named by: a pipeline's ZeRO-1 optimizer steps plain aliases of
    the stage parameters (``Pipeline.local_parameters``), each marked with its parameter."""
    return id(getattr(p, "meshrun_view_of", p))


def _fqns(model: nn.Module) -> dict[int, str]:
    """``id(param) -> FQN`` with DDP's ``module.`` and compile's prefixes removed, as
    ``get_state_dict`` names them."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    out = {}
    for name, p in model.named_parameters():
        (fqn,) = _get_fqns(model, name)  # one FQN per parameter outside legacy FSDP
        out[id(p)] = fqn
    return out


def _groups(zero: ZeroRedundancyOptimizer, fqn: dict[int, str]) -> list[dict[str, Any]]:
    return [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [fqn[_id(p)] for p in g["params"]],
        }
        for g in zero.param_groups
    ]


def zero1_state_dict(
    model: nn.Module, zero: ZeroRedundancyOptimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, plain)`` of the optimizer in ``get_state_dict``'s layout: ``tensors`` holds
    only the state of the parameters this rank owns; ``plain`` (identical on every rank: it is
    all-gathered) the param groups and every rank's non-tensor per-parameter values."""
    fqn = _fqns(model)
    owned = {fqn[_id(p)]: dict(zero.optim.state[p]) for p in zero.optim.state}
    tensors, plain = split_state({"state": owned})
    every: list[Any] = [plain.get("state", {})]
    if dist.is_initialized():
        every = [None] * dist.get_world_size(zero.process_group)
        dist.all_gather_object(every, plain.get("state", {}), group=zero.process_group)
    merged = {k: v for part in every for k, v in (part or {}).items()}
    plain_out: dict[str, Any] = {"param_groups": split_state({"g": _groups(zero, fqn)})[1]["g"]}
    if merged:
        plain_out["state"] = merged
    return tensors, plain_out


def zero1_load_template(
    model: nn.Module, zero: ZeroRedundancyOptimizer, meta: Metadata, partial: bool = False
) -> tuple[dict[str, Any], set[str]]:
    """What this rank loads from a checkpoint: empty tensors (shape and dtype from DCP's
    metadata) for the state of the parameters it owns now, nested as saved; and the flat keys
    of every parameter's state (owned or not), which this run knows about. ``partial``: the
    model is one pipeline stage's part, so the state of any parameter the checkpoint's model
    holds is known (a parameter no stage knows fails the model-key check instead)."""
    fqn = _fqns(model)
    mine = {fqn[_id(p)] for g in zero.optim.param_groups for p in g["params"]}  # its partition
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    known = set(fqn.values())
    if partial:
        known |= {k[len("model.") :] for k in meta.state_dict_metadata if k.startswith("model.")}
    template: dict[str, dict[str, torch.Tensor]] = {}
    seen: set[str] = set()
    for key, md in meta.state_dict_metadata.items():
        if not key.startswith(PREFIX):
            continue
        name, _, leaf = key[len(PREFIX) :].rpartition(".")
        if name not in known:
            continue
        seen.add(key)
        if name in mine and isinstance(md, TensorStorageMetadata):
            template.setdefault(name, {})[leaf] = torch.empty(md.size, dtype=md.properties.dtype)
    return template, seen


def zero1_load(
    model: nn.Module,
    zero: ZeroRedundancyOptimizer,
    tensors: Mapping[str, Any],
    plain: Mapping[str, Any],
    partial: bool = False,
) -> None:
    """Load the optimizer from FQN-keyed ``tensors`` (this rank's owned entries, loaded by DCP)
    and ``plain`` (param groups, non-tensor values): ZeRO's own ``load_state_dict`` takes the
    index-keyed form and keeps what this rank owns. ``partial`` (a pipeline stage): the saved
    groups name every stage's parameters; this rank takes its own."""
    from meshrun.checkpoint.state import merge_state

    full = merge_state({"state": dict(tensors)}, plain)
    index = {
        fqn: i
        for i, fqn in enumerate(
            _fqns(model)[_id(p)] for g in zero.param_groups for p in g["params"]
        )
    }
    groups = full["param_groups"]
    saved = [n for g in groups for n in g["params"]]
    missing, extra = sorted(set(index) - set(saved)), sorted(set(saved) - set(index))
    if missing or (extra and not partial):
        raise ValueError(
            f"optimizer parameters differ from the checkpoint's: missing {missing[:3]}, "
            f"extra {extra[:3]}"
        )
    state = {index[n]: v for n, v in full.get("state", {}).items() if n in index}
    zero.load_state_dict(
        {
            "state": state,
            # In this optimizer's order (ZeRO zips saved and current ids by position).
            "param_groups": [
                {**g, "params": sorted(index[n] for n in g["params"] if n in index)} for g in groups
            ],
        }
    )
