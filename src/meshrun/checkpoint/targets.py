"""What a checkpoint holds, and its collection into tensors (for DCP) and plain values (JSON).

``run.resume(model, optimizer, loader, **named)`` registers the targets; without it, interval
saves take them from the run's :class:`~meshrun.state.TrainState` (its one model or pipeline
stages, the optimizer ``run.optimizer_step`` steps, the loader position ``run.steps`` follows).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from meshrun.checkpoint.checks import CheckpointError
from meshrun.checkpoint.hf_files import HF_FILES, hf_files
from meshrun.checkpoint.pipeline import PipelineView, gather_optim_plain, maybe_pipeline_view
from meshrun.checkpoint.state import split_state
from meshrun.checkpoint.zero1 import is_zero1, zero1_state_dict
from meshrun.data.sampler import ResumableSampler
from meshrun.state import TrainState

__all__ = ["SAMPLER_AT_SAVE", "Stateful", "Targets"]

log = logging.getLogger("meshrun")
SAMPLER_AT_SAVE = "__sampler_at_save__"


class Stateful(Protocol):
    def state_dict(self) -> Mapping[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> Any: ...


class Targets:
    """The model, optimizer, data position and user objects a checkpoint saves and restores."""

    def __init__(self, state: TrainState, rank: int) -> None:
        self.state = state
        self.rank = rank
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.sampler: ResumableSampler | None = None
        self.named: dict[str, Stateful] = {}

    def register(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer,
        loader: Any = None,
        named: Mapping[str, Stateful] | None = None,
    ) -> None:
        """``model``: the (parallelized) model, or the ``Pipeline`` from ``run.pipeline``."""
        self.model, self.optimizer = maybe_pipeline_view(model) or model, optimizer
        if self.state.optimizer is None:  # known before the first step: a replica group
            self.state.optimizer = optimizer  # healing a peer then sends its state (ft/heal.py)
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, ResumableSampler):
            self.sampler = sampler
        elif loader is not None and hasattr(loader, "state_dict"):
            self.named["loader"] = loader  # e.g. torchdata's StatefulDataLoader
        elif loader is not None:
            raise CheckpointError(
                f"run.resume(..., loader={type(loader).__name__}): its position cannot be saved; "
                "build it with run.dataloader(dataset) (a ResumableSampler) or pass an object "
                "with state_dict()/load_state_dict()"
            )
        for name, obj in (named or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise CheckpointError(
                    f"run.resume(..., {name}=...): a {type(obj).__name__} has no "
                    "state_dict()/load_state_dict(); register only such objects"
                )
            self.named[name] = obj

    def resolve(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model and optimizer to save; unregistered ones come from the train state."""
        st = self.state
        if self.model is None and st.pp_group is not None:  # run.pipeline's stages
            self.model = PipelineView(list(st.models))
        elif self.model is None and len(st.models) == 1:
            self.model = st.models[0]
        if self.optimizer is None:
            self.optimizer = st.optimizer
        if self.model is None or self.optimizer is None:
            raise CheckpointError(
                "nothing to checkpoint: call run.resume(model, optimizer, loader) before the "
                "loop (it registers what is saved), or run.parallelize(model) and "
                "run.optimizer_step(optimizer)"
            )
        if self.sampler is None and st.sampler is not None:  # set once run.steps() has begun
            self.sampler = st.sampler
        return self.model, self.optimizer

    def collect(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(tensors, plain)`` of everything saved, as of now."""
        # DCP's state-dict API (with DTensor: about a second of CPU) is imported at the first
        # save, so a run that never saves does not pay for it.
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model, optimizer = self.resolve()
        self._warn_unregistered(optimizer)
        user = {name: obj.state_dict() for name, obj in self.named.items()}
        if is_zero1(optimizer):  # each rank gives the optimizer state it owns (zero1.py)
            ot, op = zero1_state_dict(model, optimizer)
            tensors, plain = split_state({"model": get_model_state_dict(model), "user": user})
            tensors.update({"optim": ot} if ot else {})
            plain["optim"] = op
        else:
            msd, osd = get_state_dict(model, optimizer)
            tensors, plain = split_state({"model": msd, "optim": osd, "user": user})
        if isinstance(model, PipelineView) and self.state.pp_group is not None:
            plain["optim"] = gather_optim_plain(plain["optim"], self.state.pp_group)
        # LambdaLR keeps its functions out of state_dict() (None here): nothing to pickle.
        tensors_only, sched_plain = split_state(
            {"s": [s.state_dict() for s in self.state.schedulers]}
        )
        if tensors_only:
            raise CheckpointError("an LR scheduler's state_dict() holds tensors: not supported")
        plain["schedulers"] = sched_plain["s"]
        # The data position of *this* step: an async save is committed steps later, when the
        # sampler has moved on (a JSON round trip makes it a copy).
        sampler = self.sampler.state_dict() if self.sampler is not None else None
        plain[SAMPLER_AT_SAVE] = json.loads(json.dumps(sampler))
        plain[HF_FILES] = hf_files(model)  # config.json of a transformers model, for export
        return tensors, plain

    def _warn_unregistered(self, optimizer: torch.optim.Optimizer) -> None:
        driven = hasattr(optimizer.step, "_wrapped_by_lr_sched")
        mine = any(s.optimizer is optimizer for s in self.state.schedulers)
        if driven and not mine and self.rank == 0:
            log.warning(
                "an LR scheduler steps this optimizer but is not saved: create it with "
                "run.lr_scheduler(optimizer) (or pass it to run.resume(..., sched=scheduler))"
            )
