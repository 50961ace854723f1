"""ZeRO-1: optimizer-state sharding with ``ZeroRedundancyOptimizer`` over the ``dp`` ranks.

Why this tool and not FSDP2: ZeRO-1 keeps full parameters and full (all-reduced) gradients on
every rank and shards only the optimizer state. FSDP2 always stores parameters sharded (its
``reshard_after_forward=False`` is ZeRO-2, with sharded gradients too), so it cannot express
stage 1. ``ZeroRedundancyOptimizer`` is made for exactly this: DDP all-reduces the gradients,
each rank steps the optimizer for its partition of the parameters, then broadcasts them.

Stage 1 changes how the optimizer is built, so the user builds it through
:func:`build_optimizer` (``run.optimizer(model, torch.optim.AdamW, lr=...)``); a plain optimizer
under ``zero = 1`` is an error at the first step (:func:`check_optimizer`), never a silent DDP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun.config import ConfigError, ParallelConfig
from meshrun.parallel.foreach import with_foreach_default
from meshrun.parallel.kinds import is_zero_redundancy
from meshrun.parallel.optim_params import reshard_fsdp
from meshrun.parallel.param_groups import check_param_groups
from meshrun.parallel.pp.kind import is_pipeline

if TYPE_CHECKING:  # parallel/pp*.py load only when a pipeline is built
    from meshrun.parallel.pp.pipeline import Pipeline


def build_optimizer(
    model: nn.Module | Pipeline,
    optimizer_class: type[torch.optim.Optimizer],
    mesh: DeviceMesh | None,
    cfg: ParallelConfig,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """``optimizer_class(model.parameters(), **kwargs)``, with its state sharded over the
    ``dp`` ranks when ``cfg.zero == 1`` (a ZeroRedundancyOptimizer, itself a torch Optimizer).
    ``model`` may be a :class:`Pipeline`: its optimizer takes this rank's stages' parameters
    (under ZeRO-1 through :meth:`Pipeline.local_parameters`). ``param_groups`` (dicts with a
    ``"params"`` list and per-group options) replace ``model.parameters()``: see
    parallel/param_groups.py for the checks. FSDP2 units are resharded first: after a forward
    without backward (an evaluation) they may hold their unsharded Parameters, which the next
    training forward no longer reads."""
    reshard_fsdp(model.modules if is_pipeline(model) else [cast(nn.Module, model)])
    params = [p for p in model.parameters() if p.requires_grad]
    zero1 = cfg.zero == 1 and mesh is not None and mesh.get_group("dp").size() > 1
    if zero1 and is_pipeline(model):
        # The stages are replicated over dp with FSDP2's replicate (parallel/ddp.py), so their
        # parameters are DTensors, which ZeRO's plain broadcast cannot take: it steps plain
        # aliases of their (whole) local tensors instead, kept in step by pipeline_step.
        params = model.local_parameters()
    # Decided on the tensors the optimizer really steps (the aliases above are plain).
    kwargs = with_foreach_default(optimizer_class, params, kwargs)
    aliases = None
    if zero1 and is_pipeline(model):  # ZeRO steps the aliases (above) in the groups
        aliases = {id(p): a for p, a in model.local_views}
    chosen = params if param_groups is None else check_param_groups(model, param_groups, aliases)
    if not zero1:
        return optimizer_class(chosen, **kwargs)
    assert mesh is not None  # zero1 implies it
    from torch.distributed.optim import ZeroRedundancyOptimizer  # ~0.3 s to import: here

    return ZeroRedundancyOptimizer(
        chosen, optimizer_class=optimizer_class, process_group=mesh.get_group("dp"), **kwargs
    )


def check_optimizer(optimizer: torch.optim.Optimizer, cfg: ParallelConfig, dp: int) -> None:
    """Refuse a plain optimizer under ``zero = 1``: its state would silently not be sharded."""
    if cfg.zero == 1 and dp > 1 and not is_zero_redundancy(optimizer):
        raise ConfigError(
            f"parallel.zero = 1 shards the optimizer state, but the optimizer is a plain "
            f"{type(optimizer).__name__}; build it with run.optimizer(model, "
            f"torch.optim.{type(optimizer).__name__}, lr=...) or set parallel.zero=0"
        )
