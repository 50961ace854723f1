"""A pipeline of a model built on the meta device: each rank allocates only its own stages.

``parallelize_pipeline`` splits the meta model (the stages only reference its modules: no
memory), applies each stage's layout on meta (TP, FSDP2 or replicate plan their shards), then
:func:`materialize_stages` allocates this rank's stage modules with ``to_empty`` and initialises
them with the model's own initialiser, so no rank ever holds more than its stages:

- a Hugging Face model: its ``_init_weights`` on every module of the stage, each called by the
  innermost ``PreTrainedModel`` above the module (what transformers' ``initialize_weights``
  dispatches). Never the model's ``init_weights()``: its ``tie_weights`` would point this rank's
  head back at the embedding, which lives on another rank and is still on meta here;
- another model: its ``init_weights()`` (meshrun's contract for meta models, as ``parallelize``
  uses). It runs over the whole model; on the other stages' parameters, still on meta, the
  in-place initialisers compute nothing.

Buffers (rotary ``inv_freq``, ``position_ids``, BatchNorm statistics) come from the same
initialiser (transformers recomputes rotary tables from the config). They are filled with NaN
after ``to_empty``; one still NaN after the initialiser is an error naming it, never a model
that runs with garbage. A tie inside a stage (one Parameter in two places) is one tensor again
after ``to_empty``; a tie across stages is made equal by parallel/pp/tied.py (the first name's
values broadcast), and a later ``load_pretrained`` fills both copies from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from meshrun.parallel.fsdp import init_weights_of

__all__ = ["StageInit", "materialize_stages", "stage_initializer"]

# Initialises the given (allocated) stage modules in place.
StageInit = Callable[[Sequence[nn.Module]], None]


def _is_hf(m: nn.Module) -> bool:
    return callable(getattr(m, "_init_weights", None)) and hasattr(m, "config")


def stage_initializer(model: nn.Module) -> StageInit:
    """The model's own initialiser for its stages; checked before anything is changed."""
    owners = {path: m for path, m in model.named_modules() if _is_hf(m)}
    if owners:
        return lambda stages: _hf_init(owners, stages)
    init = init_weights_of(model, "each rank's pipeline stages (parallel.pp)")
    return lambda stages: init()


def _owner(owners: dict[str, nn.Module], path: str) -> nn.Module:
    """The innermost Hugging Face model above the module at ``path``."""
    inside = [p for p in owners if p == "" or path == p or path.startswith(p + ".")]
    return owners[max(inside, key=len)]


def _hf_init(owners: dict[str, nn.Module], stages: Sequence[nn.Module]) -> None:
    for stage in stages:
        for fqn in stage.meshrun_parts.fqns:  # type: ignore[union-attr]
            for path, m in stage.get_submodule(fqn).named_modules(prefix=fqn):
                _owner(owners, path)._init_weights(m)  # type: ignore[operator]


def materialize_stages(stages: Sequence[nn.Module], device: torch.device, init: StageInit) -> None:
    """Allocate this rank's stage modules (after their layout: only their shards) on ``device``
    and initialise them with ``init`` (:func:`stage_initializer`)."""
    for stage in stages:
        shared = _shared_slots(stage)
        stage.to_empty(device=device)
        for slots in shared:  # to_empty gives each place a tensor of its own
            m0, n0 = slots[0]
            for m, n in slots[1:]:
                m._parameters[n] = m0._parameters[n0]
    buffers = [(n, b) for s in stages for n, b in s.named_buffers() if b.is_floating_point()]
    with torch.no_grad():
        for _, b in buffers:
            b.fill_(float("nan"))  # the marker the check below looks for
        init(stages)
    left = sorted({n for n, b in buffers if bool(torch.isnan(b).any())})
    if left:
        raise TypeError(
            f"parallel.pp: the model was on the meta device and its buffers {left[:5]} were "
            "allocated but not set by its initialiser (a Hugging Face model's _init_weights or "
            "the model's init_weights()); make init_weights() set them, or build the model on a "
            "real device"
        )


def _shared_slots(stage: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) places of each parameter held in more than one place."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in stage.modules():
        for n, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((m, n))
    return [s for s in slots.values() if len(s) > 1]
