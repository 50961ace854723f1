"""The optimizer holds the parameters the model has now.

Layouts replace a model's Parameters: FSDP2 and TP register DTensors in place of the user's
tensors, and FSDP2 registers a unit's *unsharded* Parameters from its all-gather until the
unit reshards (after the forward, or only after the backward: the root, and every unit under
ZeRO-2). An optimizer built from tensors the model no longer uses steps tensors no forward
reads and no backward fills: those parameters silently never train, and the checkpoint cannot
name their state. Three parts keep the optimizer on the current ones:

- :func:`reshard_fsdp`: every FSDP2 unit resharded, so ``model.parameters()`` are the sharded
  Parameters (``run.optimizer`` calls it first; apply_fsdp's hook after a no-grad forward);
- :class:`FormerParams`: the names of the tensors a layout replaced, recorded by
  ``run.parallelize`` before it applies the layout, so an error can name them;
- :func:`check_current`: every tensor the optimizer holds is one of the models' parameters
  (by identity), checked once per optimizer at its first ``run.optimizer_step``: one pass
  over the parameter list, no collective.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.parallel.kinds import is_fsdp_module

__all__ = ["FormerParams", "StaleParameterError", "check_current", "reshard_fsdp"]

# Path components only wrappers insert (activation checkpointing, torch.compile).
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod")


class StaleParameterError(RuntimeError):
    """The optimizer holds a tensor that is no longer a parameter of the model."""


def reshard_fsdp(modules: Iterable[nn.Module]) -> None:
    """Reshard every FSDP2 unit inside ``modules``: their registered parameters are the
    sharded ones again (a no-op for a unit that is sharded, and for a model without FSDP2)."""
    for module in modules:
        for m in module.modules():
            if is_fsdp_module(m):
                m.reshard()


def named_parameters(model: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    """The user's names of ``model``'s parameters: DDP's ``module.`` and wrappers' parts out."""
    inner = model.module if isinstance(model, DDP) else model
    for fqn, p in inner.named_parameters(remove_duplicate=False):
        yield ".".join(part for part in fqn.split(".") if part not in _WRAPPER_PARTS), p


class FormerParams:
    """Names of tensors that were parameters of a model before a layout replaced them (weak
    references: the record keeps no tensor alive)."""

    def __init__(self) -> None:
        self._names: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}

    def remember(self, model: nn.Module) -> None:
        for name, p in named_parameters(model):
            self._names[id(p)] = (weakref.ref(p), name)

    def name_of(self, t: torch.Tensor) -> str | None:
        ref, name = self._names.get(id(t), (None, ""))
        return name if ref is not None and ref() is t else None


def check_current(
    optimizer: torch.optim.Optimizer,
    models: Sequence[nn.Module],
    former: FormerParams,
    distributed: bool,
) -> None:
    """Refuse an ``optimizer`` holding a tensor none of ``models`` has as a parameter now:
    one a layout replaced or FSDP2 held unsharded, and, when ``distributed``, any other (no
    data-parallel reduction syncs its gradient: each rank would train its own copy). Nothing
    to compare against without models (``run.parallelize`` was not called)."""
    if not models:
        return
    current = {id(p) for m in models for p in m.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for i, t in enumerate(group["params"]):
            # ZeRO-1 under a pipeline steps plain aliases of the stage parameters (pp/pipeline.py)
            if id(getattr(t, "meshrun_view_of", t)) in current:
                continue
            text = _stale_text(optimizer, t, g, i, models, former)
            if distributed or text is not None:
                raise StaleParameterError(text or _unknown_text(optimizer, t, g, i))


def _stale_text(
    optimizer: torch.optim.Optimizer,
    t: torch.Tensor,
    group: int,
    index: int,
    models: Sequence[nn.Module],
    former: FormerParams,
) -> str | None:
    """The refusal for a tensor that was one of the models' parameters (None: it never was)."""
    name, why = (
        former.name_of(t),
        "the optimizer was built before run.parallelize (or run.pipeline) replaced it",
    )
    if name is None:
        name = _unsharded_name(t, models)
        why = "FSDP2 held it unsharded when the optimizer was built (a forward without backward)"
    if name is None:
        return None
    return (
        f"the {type(optimizer).__name__} holds parameter '{name}' (param_groups[{group}]"
        f"['params'][{index}]) as the model had it before: {why}, and the model now trains "
        "another tensor, which this optimizer would never update. Build the optimizer after "
        "run.parallelize with run.optimizer(model, torch.optim.AdamW, ...) (it reshards "
        "first), or call model.reshard() before torch.optim.X(model.parameters())"
    )


def _unknown_text(optimizer: torch.optim.Optimizer, t: torch.Tensor, group: int, index: int) -> str:
    return (
        f"the {type(optimizer).__name__} holds a tensor of shape {list(t.shape)} (param_groups"
        f"[{group}]['params'][{index}]) that is no parameter of the model(s) run.parallelize "
        "returned: no data-parallel reduction syncs its gradient, so each rank would train its "
        "own copy. Make it a parameter of the model (a submodule or nn.Parameter attribute) "
        "before run.parallelize and build the optimizer after it with run.optimizer(model, ...)"
    )


def _unsharded_name(t: torch.Tensor, models: Sequence[nn.Module]) -> str | None:
    """The name of the parameter whose FSDP2 unsharded Parameter ``t`` is (torch 2.13's
    FSDPParam keeps it as ``_unsharded_param``; private, so only read for this message)."""
    names = {id(p): n for m in models for n, p in named_parameters(m)}
    for module in models:
        for m in module.modules():
            if not is_fsdp_module(m):
                continue
            for group in getattr(m._get_fsdp_state(), "_fsdp_param_groups", []):
                for fp in group.fsdp_params:
                    if getattr(fp, "_unsharded_param", None) is t:
                        return names.get(id(fp.sharded_param))
    return None
