"""A pipeline of a model built on the meta device: each rank allocates only its own stages.

``parallelize_pipeline`` splits the meta model (the stages only reference its modules: no
memory), applies each stage's layout on meta (TP, FSDP2 or replicate plan their shards), then
:func:`materialize_stages` allocates this rank's stage modules with ``to_empty`` and initialises
them to one process's values (parallel/meta_init.py): the model's own ``init_weights()`` (a
Hugging Face model's included: its ``tie_weights`` acts on the full host copies only) runs
once over the whole model on full-size host copies, the other stages' parameters included,
so each stage draws what it draws on one process; each rank keeps its stages' slices.

Buffers (rotary ``inv_freq``, ``position_ids``, BatchNorm statistics) come from the same
initialiser (transformers recomputes rotary tables from the config); a floating-point
parameter or buffer it leaves unset is an error naming it, never a model that runs with
garbage. A tie inside a stage (one Parameter in two places) is one tensor again after
``to_empty``; a tie across stages is made equal by parallel/pp/tied.py (the first name's
values broadcast), and a later ``load_pretrained`` fills both copies from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from meshrun.parallel.fsdp import init_weights_of
from meshrun.parallel.meta_init import materialize_as_one_process

__all__ = ["StageInit", "materialize_stages", "stage_initializer"]

# Allocates the given stage modules on the device and initialises them.
StageInit = Callable[[Sequence[nn.Module], torch.device], None]


def stage_initializer(model: nn.Module) -> StageInit:
    """The model's own initialiser for its stages; checked before anything is changed."""
    init = init_weights_of(model, "each rank's pipeline stages (parallel.pp)")
    return lambda stages, device: materialize_as_one_process(model, init, stages, device)


def materialize_stages(stages: Sequence[nn.Module], device: torch.device, init: StageInit) -> None:
    """Allocate this rank's stage modules (after their layout: only their shards) on ``device``
    and initialise them with ``init`` (:func:`stage_initializer`)."""
    init(stages, device)
