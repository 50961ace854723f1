"""``monitor.record_steps = K``: the whole parameters and gradients of the first K optimizer
steps, written to ``RUN_DIR/record/`` for ``meshrun compare`` (diagnose/compare.py reads them).

At each of those steps, before the update, every rank gathers each parameter and its gradient
whole (``DTensor.full_tensor()``: a collective, called by every rank of the parameter's mesh in
the same ``named_parameters`` order) and one rank per pipeline stage writes them as
safetensors, under the names of the module the user built: DDP's ``module.``, compile's
``_orig_mod.`` and activation checkpointing's wrappers are not in them, so every layout's file
names a parameter alike. Off (the default) it costs one integer comparison per step.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from meshrun.hf.names import clean_name
from meshrun.train.machinery import Machinery
from meshrun.train.model import unwrap_module

__all__ = ["RECORD_DIR", "maybe_record_step", "record_file"]

RECORD_DIR = "record"


def record_file(run_dir: Path, step: int, rank: int) -> Path:
    """Where ``rank`` writes step ``step``'s tensors (1-based: the step about to be taken)."""
    return run_dir / RECORD_DIR / f"step{step:05d}-rank{rank:05d}.safetensors"


def maybe_record_step(parts: Machinery, is_step_end: bool) -> None:
    """Called by ``run.optimizer_step`` before the update: record this step when it is one of
    the first ``monitor.record_steps`` and ``is_step_end`` (the last micro-step of its
    window)."""
    if parts.state.step < parts.monitor.settings.record_steps and is_step_end:
        _record(parts)


def _record(parts: Machinery) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for model in parts.state.models:  # a pipeline rank: its stage modules
        for name, param in unwrap_module(model).named_parameters():
            fqn = clean_name(name)
            tensors[f"value/{fqn}"] = _whole(param.detach())
            if param.grad is not None:  # a frozen or unused parameter has none
                tensors[f"grad/{fqn}"] = _whole(param.grad)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if _writes(parts, rank):
        from safetensors.torch import save_file  # loaded only by a recording run

        path = record_file(parts.metrics.run_dir, parts.state.step + 1, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path))


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor  # a DDP run never loads DTensor otherwise

    full = t.full_tensor() if isinstance(t, DTensor) else t
    # A copy: views of one storage (a flat buffer's) cannot be saved as separate tensors.
    return full.detach().to("cpu", torch.float32, copy=True).contiguous()


def _writes(parts: Machinery, rank: int) -> bool:
    """The first rank of each pipeline stage writes: the mesh's outermost dim is ``pp``
    (runtime/mesh.py), so a stage holds world / pp consecutive ranks."""
    if not dist.is_initialized():
        return True
    pp_group = parts.state.pp_group
    pp = 1 if pp_group is None else pp_group.size()
    return rank % (dist.get_world_size() // pp) == 0
