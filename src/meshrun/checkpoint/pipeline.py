"""Pipeline-parallel state: this rank's stage modules seen as one module with the model's names.

``run.pipeline`` splits a model into ``StageModule``s that keep the original parameter names
(``tok_emb``, ``blocks.3.attn.q.weight``, ``model.layers.2.mlp.up_proj.weight``, ``lm_head``;
see parallel/pp/pipeline.py).
Gathering a rank's stages (unwrapped from DDP) into one container gives a module whose FQNs
are exactly the unsplit model's, so DCP's ``get_state_dict``/``set_state_dict`` work on it as on
any model: every rank writes the parameters (and optimizer state) of its own stages, and the
checkpoint has the same keys as a run without pipeline parallelism.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.checkpoint.state import decode_json, encode_json

__all__ = ["PipelineView", "gather_optim_plain", "maybe_pipeline_view"]


class PipelineView(nn.Module):
    """A container of this rank's stage parts under the unsplit model's names (never called).
    Each stage names its parts by their FQNs in the whole model (``meshrun_parts.fqns``)."""

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        for m in stages:
            stage = m.module if isinstance(m, DDP) else m
            for fqn in stage.meshrun_parts.fqns:  # type: ignore[union-attr]
                _attach(self, fqn, stage.get_submodule(fqn))
            # A transformers model's class and configs, for config.json (hf_files.py).
            self.meshrun_hf_source = getattr(stage, "meshrun_hf_source", None)

    def forward(self, *args: Any) -> Any:
        raise TypeError("a PipelineView only names the stages' parameters for checkpoints")


def _attach(root: nn.Module, fqn: str, module: nn.Module) -> None:
    *path, leaf = fqn.split(".")
    node = root
    for name in path:
        if name not in node._modules:
            node.add_module(name, nn.ModuleDict())
        node = node.get_submodule(name)
    node.add_module(leaf, module)


def maybe_pipeline_view(model: Any) -> nn.Module | None:
    """A :class:`PipelineView` of a ``Pipeline`` (duck-typed: its ``modules`` is a list of stage
    modules; checkpoint does not import parallel), else None."""
    stages = getattr(model, "modules", None)
    if isinstance(model, nn.Module) or not isinstance(stages, list):
        return None
    return PipelineView(stages)


def gather_optim_plain(plain: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """The optimizer's JSON part for the whole pipeline: each rank's param groups name only its
    own stages' parameters, and rank 0 alone writes the JSON; so the groups are all-gathered
    over the pipeline and joined (group i of every stage: the same hyper-parameters)."""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, plain, group=group)
    groups = [decode_json(p["param_groups"]) for p in every]
    merged = [dict(g) for g in groups[0]]
    for other in groups[1:]:
        for into, g in zip(merged, other, strict=True):
            into["params"] = [*into["params"], *g["params"]]
    out: dict[str, Any] = {"param_groups": encode_json(merged)}
    state = {k: v for p in every for k, v in p.get("state", {}).items()}
    if state:
        out["state"] = state
    return out
