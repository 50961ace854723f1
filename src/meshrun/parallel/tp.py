"""Tensor parallel with DTensor ``parallelize_module``, from the model's structure.

A plan maps module-name patterns (``*`` matches one name, as in ``blocks.*.attn.q``) to a
``ParallelStyle`` or a Hugging Face plan string (``"colwise"``, ``"rowwise"``,
``"embedding_rowwise"``, ...: :data:`HF_STYLES`). The plan comes from
:mod:`meshrun.parallel.structure`: the user's, the model's own (transformers' ``_tp_plan``), or
the convention (q/k/v and the MLP's up/gate column-wise, the attention output and the MLP's
down row-wise: Megatron-LM's layout, one all-reduce after attention and one after the MLP).
:func:`resolve_tp_plan` expands the patterns to module FQNs and translates the strings;
:func:`check_tp_plan` refuses, before anything changes, every split that cannot give whole
heads (fused q/k/v projections, torch's ``nn.MultiheadAttention``, transformers' ``Conv1D``,
head or feature counts ``tp`` does not divide, a tied parameter split on one side only). A
vocabulary ``tp`` does not divide (GPT-2's 50,257) is split unevenly: the embedding and a
head whose logits are gathered or loss-parallel stay DTensors, which carry uneven shards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
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
from meshrun.parallel.fsdp import WrapPredicate, is_block
from meshrun.parallel.structure import (
    COLWISE,
    ROWWISE,
    ModelStructure,
    convention_tp_plan,
    find_structure,
    matching_modules,
)

TPPlan = Mapping[str, Any]  # pattern -> ParallelStyle or a Hugging Face plan string

HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "n_kv_head", "num_key_value_heads")
OUTPUT_HEADS = ("lm_head", "output", "head")  # the vocabulary projection, outside the blocks

# Hugging Face plan strings (transformers/distributed/tensor_parallel.py) as DTensor styles.
# ``replicate`` maps to None: the module is left whole on every rank (the same numbers as a
# replicated DTensor, with no DTensor in the way of FSDP or the optimizer).
HF_STYLES: dict[str, Callable[[], ParallelStyle | None]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "sequence_parallel": SequenceParallel,
    "replicate": lambda: None,
}


def default_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The convention plan (:func:`~meshrun.parallel.structure.convention_tp_plan`) as styles:
    column-/row-wise for the recognised linear layers inside each block."""
    structure = find_structure(model)
    plan = convention_tp_plan(model, structure.blocks_fqn)
    if not plan:
        raise ConfigError(
            f"parallel.tp > 1 but meshrun found no tensor-parallel plan for "
            f"{type(model).__name__}: no nn.Linear named {sorted(COLWISE | ROWWISE)} inside "
            "a list of repeated blocks; pass run.parallelize(model, tp_plan={...}) or "
            "parallelize_fn=..."
        )
    return translate_plan(plan)


def translate_plan(plan: TPPlan) -> dict[str, ParallelStyle]:
    """Plan strings to DTensor styles (``replicate`` entries dropped); unknown ones refused."""
    out: dict[str, ParallelStyle] = {}
    for name, value in plan.items():
        style = value if isinstance(value, ParallelStyle) else _style_of(name, value)
        if style is not None:
            out[name] = style
    return out


def _style_of(name: str, value: object) -> ParallelStyle | None:
    make = HF_STYLES.get(value) if isinstance(value, str) else None
    if make is None:
        raise ConfigError(
            f"tensor-parallel plan entry {name!r}: {value!r} is not a style meshrun can apply; "
            f"supported plan strings: {sorted(HF_STYLES)}, or any torch ParallelStyle "
            "(ColwiseParallel(), ...); for others (packed_colwise, moe_tp_experts, "
            "local_*) pass parallelize_fn=..."
        )
    return make()


def resolve_tp_plan(model: nn.Module, structure: ModelStructure) -> dict[str, ParallelStyle]:
    """The structure's plan expanded to the FQNs of the modules it splits, as styles: the
    keys are the modules really split (the log counts them)."""
    if structure.tp_plan is None:
        raise ConfigError(_no_plan_reason(model, structure))
    return translate_plan(matching_modules(model, structure.tp_plan))


def _no_plan_reason(model: nn.Module, structure: ModelStructure) -> str:
    name = type(model).__name__
    conv1d = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    why = "its config declares no base_model_tp_plan and " if structure.family == "hf" else ""
    if conv1d:
        why += (
            f"its projections are transformers' Conv1D ({conv1d[0]}, ...: the weight stored "
            "transposed, [in, out]), which DTensor's column-/row-wise styles do not shard"
        )
    else:
        why += f"no nn.Linear named {sorted(COLWISE | ROWWISE)} inside repeated blocks"
    if structure.fused_qkv:
        why += f", and q/k/v are one fused projection ({structure.fused_qkv[0]})"
    return (
        f"parallel.tp > 1 but meshrun has no tensor-parallel plan for {name}: {why}; pass "
        "run.parallelize(model, tp_plan={...}) or parallelize_fn=..., or set parallel.tp=1"
    )


def sequence_parallel_plan(
    model: nn.Module, plan: TPPlan, wrap: WrapPredicate = is_block
) -> dict[str, ParallelStyle]:
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
    blocks = [n for n, m in model.named_modules() if n and wrap(n, m)]
    for name, module in model.named_modules():
        if name in blocks:
            out[name] = _BlockSequenceSplit()
        elif any(name.startswith(b + ".") for b in blocks) and isinstance(
            module, (nn.LayerNorm, nn.RMSNorm)
        ):
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
    return {**translate_plan(plan), heads[0]: head}


def check_tp_plan(
    model: nn.Module, plan: TPPlan, tp: int, structure: ModelStructure | None = None
) -> None:
    """Before anything changes: every split gives each rank whole heads and whole features,
    or an error naming the module, the value and the fix."""
    structure = structure or find_structure(model)
    split = {n: (model.get_submodule(n), s) for n, s in _expand(model, plan).items()}
    _check_module_kinds(split, structure)
    _check_torch_attention(model, split, structure)
    for name, (module, style) in split.items():
        dim, size = _split_dim(module, style)
        if dim and size % tp:
            raise ConfigError(
                f"parallel.tp = {tp} does not divide {name}.{dim} = {size} "
                f"({type(style).__name__}); choose tp in {_divisors(size)}"
            )
    _check_heads(model, structure, tp, attention_modules(model, split))
    _check_tied(structure, split)


def _expand(model: nn.Module, plan: TPPlan) -> dict[str, ParallelStyle]:
    return translate_plan(matching_modules(model, plan))


def _check_module_kinds(
    split: dict[str, tuple[nn.Module, ParallelStyle]], structure: ModelStructure
) -> None:
    """Fused q/k/v and transformers' Conv1D cannot be split by a per-module style."""
    for name, (module, _) in split.items():
        if type(module).__name__ == "Conv1D":
            raise ConfigError(
                f"tensor parallel cannot split {name}: a transformers Conv1D stores its weight "
                "transposed ([in, out]) and DTensor's column-/row-wise styles shard "
                "nn.Linear's [out, in]; leave it out of tp_plan, or pass parallelize_fn=..."
            )
    for fused in structure.fused_qkv:
        parent = fused.rpartition(".")[0]
        touched = [n for n in split if n.startswith(parent + ".")]
        if touched:
            raise ConfigError(
                f"tensor parallel cannot split the attention {parent}: {fused} computes q, k "
                "and v in one projection, so a column-wise split gives a rank all of q and "
                "part of k instead of whole heads, and the attention's forward splits and "
                "reshapes by the full width; leave the attention out of tp_plan (split the "
                "MLP only, e.g. {'transformer.h.*.mlp.c_fc': 'colwise', "
                "'transformer.h.*.mlp.c_proj': 'rowwise'}), or set parallel.tp=1"
            )


def _check_torch_attention(
    model: nn.Module, split: Mapping[str, object], structure: ModelStructure
) -> None:
    """torch's ``nn.MultiheadAttention`` cannot be split by heads from outside: q, k and v are
    one fused Parameter (``in_proj_weight``, no module a style can split), and its forward,
    ``F.multi_head_attention_forward``, reshapes by the full width and calls ``out_proj``'s
    weight directly (the module's hooks never run: a split ``out_proj`` fails at step 1 with
    "mixed torch.Tensor and DTensor")."""
    for mha, module in torch_attention_modules(model).items():
        touched = [n for n in split if n == mha or n.startswith(mha + ".")]
        if not touched:
            continue
        raise ConfigError(
            f"tensor parallel cannot split {mha} (torch's nn.MultiheadAttention; the plan "
            f"splits {touched[0]}): its q, k and v are one fused Parameter (in_proj_weight, "
            "not a module a column-wise style can split by heads) and "
            f"F.multi_head_attention_forward needs all {module.num_heads} heads on one rank; "
            f"leave the attention whole and split the feed-forward only "
            f"({_mlp_plan_hint(structure)}), or shard with parallel.dp_shard / parallel.pp "
            "instead, or write the attention with separate q/k/v nn.Linear layers, or set "
            "parallel.tp=1"
        )


def torch_attention_modules(model: nn.Module) -> dict[str, nn.MultiheadAttention]:
    """FQN -> each ``nn.MultiheadAttention`` in ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}


def _mlp_plan_hint(structure: ModelStructure) -> str:
    """torch's ``nn.TransformerEncoderLayer`` / ``DecoderLayer`` name their feed-forward
    ``linear1`` (up) and ``linear2`` (down): the plan that splits it, for these blocks."""
    blocks = structure.blocks_fqn
    if blocks is not None and structure.block_class.startswith("Transformer"):
        plan = {f"{blocks}.*.linear1": "colwise", f"{blocks}.*.linear2": "rowwise"}
        return f"run.parallelize(model, tp_plan={plan})"
    return "run.parallelize(model, tp_plan={'<up>': 'colwise', '<down>': 'rowwise'})"


# Last names of the attention's own projections (q/k/v and the output), in the common
# spellings: a plan that splits one of these splits the attention by heads.
ATTENTION_PROJECTIONS = {"q", "k", "v", "q_proj", "k_proj", "v_proj", "wq", "wk", "wv"}
ATTENTION_PROJECTIONS |= {"o_proj", "wo", "out_proj", "query", "key", "value"}


def attention_modules(model: nn.Module, split: Mapping[str, object]) -> set[str]:
    """The attention modules whose projections ``split`` splits: the parents of split layers
    that are attention projections by name, or whose parent holds a head count or is named
    like an attention (``attn``, ``attention``, ``self_attn``). An MLP-only plan gives none."""
    out = set()
    for name in split:
        parent, _, last = name.rpartition(".")
        if not parent:
            continue  # a top-level layer (the head, the embedding) is no attention's part
        owner = model.get_submodule(parent)
        by_heads = any(isinstance(getattr(owner, a, None), int) for a in HEAD_ATTRS)
        by_name = any("attn" in part or "attention" in part for part in parent.lower().split("."))
        if last.lower() in ATTENTION_PROJECTIONS or by_heads or by_name:
            out.add(parent)
    return out


def _check_heads(model: nn.Module, structure: ModelStructure, tp: int, split: set[str]) -> None:
    """Whole heads on each rank, checked only where the plan splits an attention (``split``:
    :func:`attention_modules`): the model's head counts, and those held by the split
    attentions or the modules above them. An MLP-only plan leaves every attention whole on
    every rank, and its heads need not divide (a GPT with 3 heads trains MLP-split on 2)."""
    if not split:
        return
    where = structure.sources.get("heads", "model")
    counts = [(where, structure.num_heads)]
    if structure.num_kv_heads != structure.num_heads:
        kv_name = "num_key_value_heads" if where.startswith("config.") else "kv heads"
        counts.append((f"{where.rpartition('.')[0] or 'model'}.{kv_name}", structure.num_kv_heads))
    above = {a.rsplit(".", i)[0] for a in split for i in range(a.count(".") + 1)} | {""}
    for name in sorted(split | above):
        module = model.get_submodule(name)
        counts += [(f"{name or 'model'}.{a}", getattr(module, a, None)) for a in HEAD_ATTRS]
    whole = tuple(f"{n}." for n in torch_attention_modules(model))  # never split (refused)
    for label, n in counts:
        if (
            isinstance(n, int)
            and not isinstance(n, bool)
            and n % tp
            and not label.startswith(whole)
        ):
            raise ConfigError(
                f"parallel.tp = {tp} does not divide {label} = {n}: each tensor-parallel rank "
                f"must hold whole heads; choose tp in {_divisors(n)}, or split the MLP only "
                "(a tp_plan without the attention's projections)"
            )


def _weight_shard_dim(module: nn.Module, style: ParallelStyle) -> int | None:
    """The dim of ``module.weight`` that ``style`` shards (Linear [out, in], Embedding [V, C])."""
    colwise = isinstance(style, ColwiseParallel)
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        if isinstance(module, nn.Embedding):
            return 1 if colwise else 0
        return 0 if colwise else 1
    return None


def _check_tied(
    structure: ModelStructure, split: dict[str, tuple[nn.Module, ParallelStyle]]
) -> None:
    """A tied pair is split the same way on both sides (then re-tied by :func:`apply_tp`),
    or not at all: one side split and the other whole would train two tensors."""
    for a, b in structure.tied:
        dims = []
        for fqn in (a, b):
            entry = split.get(fqn.rpartition(".")[0])
            dims.append(None if entry is None else _weight_shard_dim(*entry))
        if dims[0] != dims[1]:
            raise ConfigError(
                f"{a} and {b} are one tensor (tied), but the tensor-parallel plan shards them "
                f"differently (dim {dims[0]} vs dim {dims[1]}; None: not split), which would "
                "train them as two tensors; split both along the vocabulary (the embedding "
                "'embedding_rowwise', the head 'colwise') or neither, or untie them"
            )


def _split_dim(module: nn.Module, style: ParallelStyle) -> tuple[str, int]:
    if not isinstance(module, nn.Linear) or uneven_split_ok(style):
        return "", 0
    if isinstance(style, ColwiseParallel):
        return "out_features", module.out_features
    if isinstance(style, RowwiseParallel):
        return "in_features", module.in_features
    return "", 0


def uneven_split_ok(style: ParallelStyle) -> bool:
    """Whether ``style`` may split a dim that tp does not divide. DTensor shards unevenly
    (``torch.chunk``'s sizes: 257 over 2 ranks is 129 + 128) and keeps the global shape while
    the split dim is a DTensor: a column-wise layer whose output is gathered (``colwise_rep``,
    transformers' ``colwise_gather_output`` on ``lm_head``) or kept as a DTensor (loss
    parallel), a row-wise one that splits a replicated input itself, an embedding. A split
    output handed on as a local tensor (plain ``colwise``) is read by the next layer's
    ``DTensor.from_local``, which assumes equal shards: that one must divide."""
    if isinstance(style, ColwiseParallel):
        return style.output_layouts != (Shard(-1),) or not style.use_local_output
    if isinstance(style, RowwiseParallel):
        return style.input_layouts == (Replicate(),)
    return False


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def apply_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: TPPlan,
    tied: tuple[tuple[str, str], ...] = (),
) -> nn.Module:
    """Split ``model`` in place over the 1-D ``tp`` mesh by ``plan`` (checked: check_tp_plan).

    ``parallelize_module`` makes each module's parameters new DTensor Parameters, so a tied
    pair split on both sides becomes two tensors: the second name is pointed at the first's
    DTensor again (the placements are equal, checked), so they stay one tensor."""
    parallelize_module(model, mesh, translate_plan(plan))
    for a, b in tied:
        keep = model.get_parameter(a)
        if isinstance(keep, DTensor) and model.get_parameter(b) is not keep:
            owner, _, attr = b.rpartition(".")
            setattr(model.get_submodule(owner), attr, keep)
    return model


def build_tp_plan(
    model: nn.Module,
    structure: ModelStructure,
    tp: int,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> dict[str, ParallelStyle]:
    """The structure's plan, checked (:func:`check_tp_plan`), expanded to module FQNs, plus
    sequence parallel and loss parallel when asked."""
    plan = resolve_tp_plan(model, structure)
    check_tp_plan(model, plan, tp, structure)  # on the plain plan: it names the split layers
    if sequence_parallel:
        if structure.family == "hf":
            raise ConfigError(
                f"parallel.sequence_parallel = true is not supported on transformers' "
                f"{structure.model_class}: its decoder layers take position embeddings and "
                "masks for the whole sequence and its norms are not torch's LayerNorm/RMSNorm; "
                "set parallel.sequence_parallel=false"
            )
        plan = sequence_parallel_plan(model, plan, structure.is_block)
    if loss_parallel:
        # Not checked for divisibility: DTensor shards the vocabulary unevenly (the demo's
        # 257 over tp=2 gives the one-process loss and gradient: measured).
        plan = loss_parallel_plan(model, plan)
    return plan


def count_split(model: nn.Module) -> int:
    """Modules whose own parameters are DTensors: what tensor parallel really split."""
    return sum(
        any(isinstance(p, DTensor) for p in m.parameters(recurse=False)) for m in model.modules()
    )
