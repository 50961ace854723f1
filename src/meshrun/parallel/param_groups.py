"""Parameter groups (``[{"params": [...], "weight_decay": 0.1}, ...]``, as nanoGPT's weight-decay
groups) for an optimizer built after the layout, checked against the parallelized model.

Why the check: FSDP2 (ZeRO-2/3) and TP replace a module's parameters with DTensors, so groups
collected before ``run.parallelize`` hold tensors the model no longer trains; an optimizer over
them steps nothing the model uses, without an error. A trainable parameter left out of every
group would silently stay at its initial value. Both are refused here, naming the parameters.

Under pipeline parallelism with ZeRO-1 the optimizer steps plain aliases of the stage
parameters (``Pipeline.local_parameters``): each group's parameters are swapped for their
aliases, the other keys kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from meshrun.config import ConfigError
from meshrun.parallel.pp.kind import is_pipeline

if TYPE_CHECKING:  # parallel/pp*.py load only when a pipeline is built
    from meshrun.parallel.pp.pipeline import Pipeline

__all__ = ["check_param_groups"]

_FIX = (
    "build the groups from the model that run.parallelize / run.pipeline returned, after that "
    "call (FSDP2 and TP replace the parameters with DTensors)"
)


def _named(model: nn.Module | Pipeline) -> list[tuple[str, nn.Parameter]]:
    if is_pipeline(model):
        return [
            (f"stage{i}.{n}", p)
            for i, m in enumerate(model.modules)
            for n, p in m.named_parameters()
        ]
    return list(cast(nn.Module, model).named_parameters())  # TypeGuard narrows only if True


def _group_params(i: int, group: Mapping[str, Any]) -> list[torch.Tensor]:
    if not isinstance(group, Mapping) or "params" not in group:
        raise ConfigError(
            f"param_groups[{i}] is {type(group).__name__} {str(group)[:60]!r}; each group is a "
            'dict with a "params" list, e.g. {"params": decay, "weight_decay": 0.1}'
        )
    params = group["params"]
    return [params] if isinstance(params, torch.Tensor) else list(params)


def check_param_groups(
    model: nn.Module | Pipeline,
    param_groups: Sequence[Mapping[str, Any]],
    aliases: Mapping[int, nn.Parameter] | None = None,
) -> list[dict[str, Any]]:
    """``param_groups`` as lists the optimizer can take, checked: every tensor in them is a
    parameter of ``model``, and every trainable parameter of ``model`` is in a group.
    ``aliases`` (id of a stage parameter -> the tensor the optimizer steps) replaces them."""
    named = _named(model)
    names = {id(p): n for n, p in named}
    out, seen = [], set()
    for i, group in enumerate(param_groups):
        params = _group_params(i, group)
        strangers = [p for p in params if id(p) not in names]
        if strangers:
            shapes = ", ".join(str(tuple(p.shape)) for p in strangers[:4])
            raise ConfigError(
                f"param_groups[{i}] holds {len(strangers)} tensor(s) that are not parameters of "
                f"the parallelized {type(model).__name__} (shapes {shapes}); {_FIX}"
            )
        seen |= {id(p) for p in params}
        mapped = [aliases.get(id(p), p) for p in params] if aliases else params
        out.append({**group, "params": mapped})
    _refuse_left_out(named, seen)
    return out


def _refuse_left_out(named: Iterable[tuple[str, nn.Parameter]], seen: set[int]) -> None:
    left = [n for n, p in named if p.requires_grad and id(p) not in seen]
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise ConfigError(
            f"param_groups leave {len(left)} trainable parameter(s) out of every group ({shown}):"
            " they would never be updated; put them in a group, or freeze them with "
            "p.requires_grad_(False) before run.parallelize"
        )
