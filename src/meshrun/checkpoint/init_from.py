"""``checkpoint.init_from = PATH``: a fresh run (nothing to resume) starts from these weights.

Weights only: the optimizer, the step, the schedulers, the data position and the RNG streams
start fresh. ``PATH`` is either

- a Hugging Face directory (``model.safetensors`` or its index): read sharded by
  :func:`meshrun.hf.load_pretrained`, each rank its own slices;
- a meshrun checkpoint: a step directory (``step_000100``) or a checkpoint root (its newest
  valid step), validated like a resume (manifest, checksums), and read through DCP, which
  re-shards the model tensors onto this run's layout. Only the ``model.`` tensors are read;
  DCP's pickled metadata only through the restricted unpickler (safe_metadata.py), and the
  non-tensor state (JSON) is not read at all.

Each tensor loads in the dtype it was saved in, or is cast from one floating-point dtype to
another with a printed line; an integer or bool tensor on either side of a different dtype is
an error naming the key and both dtypes (DCP would convert it silently).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshrun.checkpoint import on_disk
from meshrun.checkpoint.checks import CheckpointError, pick
from meshrun.checkpoint.pipeline import PipelineView
from meshrun.hf.reading import is_hf_directory

__all__ = ["load_initial_weights"]

log = logging.getLogger("meshrun")


def load_initial_weights(path: Path, model: nn.Module, device: torch.device, rank: int) -> str:
    """Fill ``model`` (collective: every rank) from ``path``; returns what was loaded, for the
    log line."""
    # A meshrun checkpoint may hold a config.json too (saved for export): its manifest decides.
    meshrun_dir = (path / on_disk.MANIFEST).is_file() or bool(on_disk.list_checkpoints(path))
    if not meshrun_dir and is_hf_directory(path):
        from meshrun.hf.load import load_pretrained

        partial = isinstance(model, PipelineView)  # this rank's stages only
        report = load_pretrained(model, path, device=device, partial=partial)
        what = f"Hugging Face weights ({report.tensors} tensors, names {report.rule})"
    else:
        step = _step_dir(path)
        _load_meshrun_model(step, model)
        what = f"the model tensors of meshrun checkpoint {step.name}"
    if rank == 0:
        log.info("checkpoint.init_from: %s from %s (optimizer and step start fresh)", what, path)
    return what


def _step_dir(path: Path) -> Path:
    """``path`` itself when it is a valid step directory, else its newest valid step."""
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint.init_from = {str(path)!r} is not a directory; give a meshrun checkpoint "
            "(a step directory or a checkpoint root) or a Hugging Face directory"
        )
    if (path / on_disk.MANIFEST).is_file():
        bad = on_disk.problems(path)
        if bad:
            raise CheckpointError(
                f"checkpoint.init_from = {str(path)!r} is not a valid checkpoint: "
                f"{'; '.join(bad)}; pick another (meshrun ckpt list)"
            )
        return path
    found = pick(path, "auto")
    if found is None:
        raise CheckpointError(
            f"checkpoint.init_from = {str(path)!r} holds no valid meshrun checkpoint and no "
            "Hugging Face weights (config.json, *.safetensors); give a step directory, a "
            "checkpoint root or a save_pretrained directory"
        )
    return Path(found)


def _load_meshrun_model(path: Path, model: nn.Module) -> None:
    """The checkpoint's ``model.`` tensors into this run's layout (DCP re-shards them)."""
    # here: a run that loads nothing never imports DCP
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from meshrun.checkpoint import safe_metadata

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    meta = safe_metadata.read_metadata(path)
    saved = {k for k in meta.state_dict_metadata if k.startswith("model.")}
    flat = flatten_state_dict(state)[0]
    wanted = set(flat)
    missing = sorted(wanted - saved)
    if missing:
        raise CheckpointError(
            f"checkpoint.init_from: {path} lacks {len(missing)} tensor(s) of this model, e.g. "
            f"{missing[:5]}: start from a checkpoint of the same model"
        )
    if not isinstance(model, PipelineView):  # a pipeline rank holds only its stages' names
        extra = sorted(saved - wanted)
        if extra:
            raise CheckpointError(
                f"checkpoint.init_from: {path} holds {len(extra)} model tensor(s) this model "
                f"lacks, e.g. {extra[:5]}: start from a checkpoint of the same model"
            )
    _check_dtypes(path, meta, flat)
    safe_metadata.load(state, path)
    set_model_state_dict(model, state["model"])


def _check_dtypes(path: Path, meta: Any, flat: dict[str, Any]) -> None:
    from meshrun.checkpoint.safe_metadata import cast_text, dtype_casts

    errors, casts = dtype_casts(meta, flat)
    if errors:
        raise CheckpointError(
            f"checkpoint.init_from: {path} holds {len(errors)} tensor(s) of another kind than "
            f"this model's: {'; '.join(errors[:5])}; loading would convert them silently (an "
            "integer tensor into a float parameter): build the model with the saved dtypes"
        )
    if casts:
        log.warning("checkpoint.init_from: %s: cast while loading: %s", path, cast_text(casts))
