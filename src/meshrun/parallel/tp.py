"""Tensor parallel with DTensor ``parallelize_module``.

A plan maps module-name patterns (``*`` matches one name, as in ``blocks.*.attn.q``) to
``ParallelStyle`` objects. :func:`default_tp_plan` finds the usual transformer shapes inside
each block of a ``blocks``/``layers``/``h`` ModuleList: q/k/v (and the MLP's up/gate) split
column-wise, the attention output and the MLP's down projection row-wise, so each block needs
one all-reduce after attention and one after the MLP (Megatron-LM's layout). Embeddings, norms
and the head stay replicated.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshrun.config import ConfigError
from meshrun.parallel.fsdp import is_block

TPPlan = Mapping[str, ParallelStyle]

# Last names of nn.Linear layers in common blocks (GPT-2, Llama, nanoGPT, meshrun's demo).
COLWISE = {"q", "k", "v", "q_proj", "k_proj", "v_proj", "wq", "wk", "wv"}
COLWISE |= {"up", "gate", "up_proj", "gate_proj", "w1", "w3", "fc1", "c_fc"}
ROWWISE = {"proj", "o_proj", "wo", "out_proj", "down", "down_proj", "w2", "fc2"}
HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "n_kv_head", "num_key_value_heads")
OUTPUT_HEADS = ("lm_head", "output", "head")  # the vocabulary projection, outside the blocks


def default_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """Column-/row-wise styles for the recognised linear layers inside each block."""
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not _inside_block(name):
            continue
        last = name.rpartition(".")[2]
        if last in COLWISE:
            plan[name] = ColwiseParallel()
        elif last in ROWWISE:
            plan[name] = RowwiseParallel()
    if not plan:
        raise ConfigError(
            f"parallel.tp > 1 but meshrun found no tensor-parallel plan for "
            f"{type(model).__name__}: no nn.Linear named {sorted(COLWISE | ROWWISE)} inside a "
            "blocks/layers/h ModuleList; pass run.parallelize(model, tp_plan={...}) or "
            "parallelize_fn=..."
        )
    return plan


def sequence_parallel_plan(model: nn.Module, plan: TPPlan) -> dict[str, ParallelStyle]:
    """``plan`` plus sequence parallel inside each block: the block's input is split along the
    sequence (a local slice, no communication), norms run on the slices, each attention/MLP
    module all-gathers its input, its row-wise output layer reduce-scatters back to slices
    (instead of an all-reduce: the same bytes, less activation memory), and the block's output
    is all-gathered again. Embeddings and head stay as they are, so the demo's position
    embedding needs no change."""
    out = dict(plan)
    for name in [n for n, s in plan.items() if isinstance(s, RowwiseParallel)]:
        out[name] = RowwiseParallel(output_layouts=Shard(1))
    for name in {n.rpartition(".")[0] for n, s in plan.items() if isinstance(s, ColwiseParallel)}:
        out[name] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    for name, module in model.named_modules():
        if name and is_block(name, module):
            out[name] = _BlockSequenceSplit()
        elif _inside_block(name) and isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            out[name] = SequenceParallel()
    return out


class _BlockSequenceSplit(ParallelStyle):
    """A block's input: replicated -> sequence slices; its output: slices -> replicated."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        split = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
        )
        gather = PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)
        )
        return gather._apply(split._apply(module, device_mesh), device_mesh)


def loss_parallel_plan(model: nn.Module, plan: TPPlan) -> dict[str, ParallelStyle]:
    """``plan`` plus the output head split column-wise over the vocabulary, its logits kept as
    a DTensor sharded on the last dim (``use_local_output=False``): cross-entropy computed
    under ``torch.distributed.tensor.parallel.loss_parallel()`` then never gathers the whole
    (batch x sequence x vocabulary) logits on one rank (Megatron-LM's vocab-parallel loss)."""
    heads = [n for n in OUTPUT_HEADS if isinstance(getattr(model, n, None), nn.Linear)]
    if not heads:
        raise ConfigError(
            f"parallel.loss_parallel = true needs the output projection as a top-level nn.Linear "
            f"named one of {list(OUTPUT_HEADS)}, but {type(model).__name__} has none; pass a "
            "tp_plan with your head as ColwiseParallel(output_layouts=Shard(-1), "
            "use_local_output=False), or set parallel.loss_parallel=false"
        )
    head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return {**plan, heads[0]: head}


def _inside_block(name: str) -> bool:
    parts = name.split(".")
    return any(is_block(".".join(parts[: i + 1]), None) for i in range(len(parts) - 1))


def check_tp_plan(model: nn.Module, plan: TPPlan, tp: int) -> None:
    """tp must divide every split dimension and every head count: an error naming the module."""
    for name, (module, style) in _match(model, plan).items():
        if not isinstance(module, nn.Linear):
            continue
        dim, size = _split_dim(module, style)
        if dim and size % tp:
            raise ConfigError(
                f"parallel.tp = {tp} does not divide {name}.{dim} = {size} "
                f"({type(style).__name__}); choose tp in {_divisors(size)}"
            )
    for name, module in model.named_modules():
        for attr in HEAD_ATTRS:
            n = getattr(module, attr, None)
            if isinstance(n, int) and n % tp:
                raise ConfigError(
                    f"parallel.tp = {tp} does not divide {name or 'model'}.{attr} = {n}: each "
                    f"tensor-parallel rank must hold whole heads; choose tp in {_divisors(n)}"
                )


def _split_dim(module: nn.Linear, style: ParallelStyle) -> tuple[str, int]:
    if isinstance(style, ColwiseParallel):
        return "out_features", module.out_features
    if isinstance(style, RowwiseParallel):
        return "in_features", module.in_features
    return "", 0


def _match(model: nn.Module, plan: TPPlan) -> dict[str, tuple[nn.Module, ParallelStyle]]:
    """Modules named by the plan's patterns (``*`` matches one name, as parallelize_module)."""
    out: dict[str, tuple[nn.Module, ParallelStyle]] = {}
    for name, module in model.named_modules():
        for pattern, style in plan.items():
            parts, pats = name.split("."), pattern.split(".")
            if len(parts) == len(pats) and all(map(fnmatch.fnmatchcase, parts, pats)):
                out[name] = (module, style)
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def apply_tp(model: nn.Module, mesh: DeviceMesh, plan: TPPlan) -> nn.Module:
    """Split ``model`` in place over the 1-D ``tp`` mesh by ``plan`` (checked: check_tp_plan)."""
    return parallelize_module(model, mesh, dict(plan))
