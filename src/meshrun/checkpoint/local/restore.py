"""One rank's node-local shard: what it holds (the same collection the shared checkpoint
saves, ``Targets.collect``) and its load back into the same layout on the same world.

Same world, same config: every tensor of the shard has its counterpart of the same shape in
this run's state dict (a DTensor's local shard), so loading copies each one into the template
``get_state_dict`` gives, as DCP fills it on the shared path, and ``set_state_dict`` (or ZeRO-1's
own load) takes it from there. The plain values, the data position, the schedulers and the RNG
streams are restored as the shared resume restores them.
"""

from __future__ import annotations

from typing import Any

import torch

from meshrun.checkpoint.checks import CheckpointError, layout_text
from meshrun.checkpoint.hf_files import HF_FILES
from meshrun.checkpoint.local.files import to_local
from meshrun.checkpoint.pipeline import PipelineView
from meshrun.checkpoint.resume import restore_progress
from meshrun.checkpoint.state import capture_rng, merge_state, restore_rng, split_state
from meshrun.checkpoint.targets import SAMPLER_AT_SAVE, Targets
from meshrun.checkpoint.zero1 import is_zero1, zero1_load
from meshrun.parallel.kinds import is_dtensor

__all__ = ["collect_shard", "load_shard"]


def collect_shard(targets: Targets, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, meta)`` of this rank's state now: local tensors on the CPU, and as JSON the
    step, data position, plain values (optimizer groups, schedulers) and this rank's RNG."""
    tensors, plain = targets.collect()
    meta = {
        "step": step,
        "sampler": plain[SAMPLER_AT_SAVE],
        "plain": {k: v for k, v in plain.items() if k not in (SAMPLER_AT_SAVE, HF_FILES)},
        "rng": capture_rng(),
        "layout": layout_text(targets.model),
    }
    return to_local(tensors), meta


def load_shard(targets: Targets, tensors: dict[str, Any], meta: dict[str, Any], name: str) -> int:
    """Load one rank's shard into the registered targets; returns its step."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    model, optimizer = targets.resolve()
    if meta["layout"] != layout_text(model):
        raise CheckpointError(f"{name}: written under layout {meta['layout']}, not this run's")
    plain = meta["plain"]
    user = targets.user_template(plain.get("user", {}))
    if not is_zero1(optimizer):
        msd, osd = get_state_dict(model, optimizer)
        template, _ = split_state({"model": msd, "optim": osd, "user": user})
        _fill(template, tensors, name)
        full = merge_state(template, plain)
        set_state_dict(
            model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optim"]
        )
    else:  # ZeRO-1: the shard holds the optimizer state of the parameters this rank owns
        owned = tensors.pop("optim", {}).get("state", {})
        template, _ = split_state({"model": get_model_state_dict(model), "user": user})
        _fill(template, tensors, name)
        full = merge_state(template, plain)
        set_model_state_dict(model, full["model"])
        stage = isinstance(model, PipelineView)
        zero1_load(model, optimizer, owned, plain["optim"], partial=stage)
    targets.load_user(full["user"])
    restore_progress(targets, meta, name)
    restore_rng(meta["rng"])
    return int(meta["step"])


def _fill(template: dict[str, Any], saved: dict[str, Any], where: str) -> None:
    """Copy ``saved`` into ``template`` in place, key by key; any difference is an error."""
    if template.keys() != saved.keys():
        missing, extra = sorted(template.keys() - saved.keys()), sorted(saved.keys() - template)
        raise CheckpointError(
            f"{where}: keys differ from this run's (missing {missing[:3]}, extra {extra[:3]})"
        )
    for key, dst in template.items():
        src, here = saved[key], f"{where}:{key}"
        if isinstance(dst, dict):
            if not isinstance(src, dict):
                raise CheckpointError(f"{here}: a tensor where this run has a group of them")
            _fill(dst, src, here)
            continue
        local = dst.to_local() if is_dtensor(dst) else dst
        if (
            not isinstance(src, torch.Tensor)
            or src.shape != local.shape
            or src.dtype != local.dtype
        ):
            got = tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__
            raise CheckpointError(
                f"{here}: saved {got}, this run has {tuple(local.shape)} {local.dtype}"
            )
        with torch.no_grad():
            local.copy_(src)
