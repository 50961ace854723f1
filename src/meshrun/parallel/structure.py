"""The structure of a model, read once and shared by every layout: its repeated blocks (FSDP
units, activation-checkpointing units, pipeline split points), what runs before and after them
(embeddings, final norm, head), its tied parameters, its attention heads and a tensor-parallel
plan.

Found in this order, each field on its own:

1. what the user passes (:class:`ModelSpec`, ``run.parallelize(model, spec=ModelSpec(...))``);
2. what the model declares: Hugging Face transformers' ``_no_split_modules``, ``_tp_plan`` /
   ``config.base_model_tp_plan``, ``_pp_plan``, ``config.num_attention_heads`` /
   ``num_key_value_heads`` (read as attributes: transformers is never imported here);
3. conventions: a ``ModuleList`` (or torchtitan's ``ModuleDict``) of identical blocks, the
   head-count attributes of nanoGPT, torchtitan and the demo (``n_head``, ``n_kv_heads``, ...);
4. else the field stays empty, and the layout that needs it refuses, naming what to pass.

Tied parameters are found for real: one tensor object under two names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from meshrun.config import ConfigError

# Names of the ModuleList of blocks by convention: nanoGPT/GPT-2 ``h``, Llama/torchtitan
# ``layers``, meshrun's demo ``blocks``. Tried first; any list of identical blocks after them.
BLOCK_LIST_NAMES = ("blocks", "layers", "h")
HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads")
KV_HEAD_ATTRS = ("n_kv_head", "n_kv_heads", "num_kv_heads", "num_key_value_heads")


@dataclass(frozen=True)
class ExpertsDecl:
    """Where the experts of a mixture-of-experts model are (``ModelSpec(experts=...)``; a plain
    string is the ``pattern``). ``pattern``: an fnmatch pattern over module FQNs, e.g.
    ``"blocks.*.moe.experts"``; each match is an expert container called as ``experts(hidden
    [N, H], top_k_index [N, K], top_k_weights [N, K]) -> [N, H]`` (the routing stays in the
    user's block). Its tensors with E on ``expert_dim`` are split over ``parallel.ep``, or its
    ``nn.ModuleList`` of E experts is sliced; ``num_experts_attr`` holds E (set to E / ep)."""

    pattern: str
    num_experts_attr: str = "num_experts"
    expert_dim: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """What a user may tell meshrun about a model (docs/parallel.md, "Your model's structure").

    ``blocks``: the FQN of the ``nn.ModuleList`` (or ``ModuleDict``/``Sequential``) of repeated
    blocks, e.g. ``"transformer.h"``. ``split_points``: FQNs where a new pipeline stage starts
    (torchtitan's ``module_fqns_per_model_part``). ``tp_plan``: module-FQN patterns (``*``
    matches one name) to a ``ParallelStyle`` or a Hugging Face plan string (``"colwise"``,
    ...). ``tied``: parameter-FQN pairs that share one tensor. ``num_heads`` /
    ``num_kv_heads``: the attention head counts, for the tensor-parallel checks. ``before`` /
    ``after``: FQNs of the modules that run before the blocks (embeddings first) and after
    them (final norm, head), in forward order, where the order they are registered in is not
    the forward's (``nn.Transformer`` registers ``encoder`` before a subclass's embedding).
    ``experts``: the expert containers of a mixture-of-experts model (:class:`ExpertsDecl`, or
    its pattern), for ``parallel.ep``. ``example_input``: what the model's forward takes (a
    tensor or a tuple of them, any values: only shapes and dtypes are used), to check a
    tensor-parallel plan before step 1 where meshrun cannot derive one (token ids when the
    first layer is an ``nn.Embedding``)."""

    blocks: str | None = None
    split_points: tuple[str, ...] = ()
    before: tuple[str, ...] | None = None
    after: tuple[str, ...] | None = None
    tp_plan: Mapping[str, Any] | None = None
    tied: tuple[tuple[str, str], ...] | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    experts: str | ExpertsDecl | None = None
    example_input: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class ModelStructure:
    """What :func:`find_structure` found, and from where (``sources``, for the start-up line)."""

    blocks_fqn: str | None
    n_blocks: int
    block_class: str
    block_keys: tuple[str, ...]  # the container's child names ("0", "1", ...), in order
    before: tuple[str, ...]
    after: tuple[str, ...]
    tied: tuple[tuple[str, str], ...]
    num_heads: int | None
    num_kv_heads: int | None
    tp_plan: dict[str, Any] | None
    tp_plan_source: str
    family: str
    split_points: tuple[str, ...] = ()
    pp_plan: dict[str, Any] | None = None
    fused_qkv: tuple[str, ...] = ()
    model_class: str = ""
    sources: dict[str, str] = field(default_factory=dict)
    example_input: Any = field(default=None, compare=False)  # ModelSpec.example_input

    def block_names(self) -> list[str]:
        """The FQNs of the blocks, in order (empty when none were found)."""
        if self.blocks_fqn is None:
            return []
        return [f"{self.blocks_fqn}.{i}" for i in self.block_keys]

    def is_block(self, name: str, module: nn.Module | None = None) -> bool:
        """A ``WrapPredicate``: ``name`` is one of the blocks (FSDP unit, AC unit)."""
        parent, _, key = name.rpartition(".")
        return self.blocks_fqn is not None and parent == self.blocks_fqn and key in self.block_keys

    def require_blocks(self, purpose: str) -> str:
        """The blocks' FQN, or an error saying what ``purpose`` needs and what to pass."""
        if self.blocks_fqn is None:
            raise ConfigError(
                f"{purpose} needs the model's repeated blocks, but meshrun found none in "
                f"{self.model_class}: no nn.ModuleList of identical modules and no "
                "_no_split_modules; pass run.parallelize(model, spec=ModelSpec(blocks="
                "'path.to.blocks'))"
            )
        return self.blocks_fqn

    def describe(self) -> str:
        """The one start-up line: what was found and from where."""
        if self.blocks_fqn is None:
            blocks = "blocks: none found"
        else:
            blocks = (
                f"blocks: {self.blocks_fqn} ({self.n_blocks} x {self.block_class}, "
                f"from {self.sources['blocks']})"
            )
        if self.tp_plan is None:
            plan = "TP plan: none"
        else:
            plan = (
                f"TP plan: {self.tp_plan_source} ({len(self.tp_plan)} rules, "
                f"{self.sources.get('tp_modules', '?')} modules)"
            )
        heads = "heads: unknown"
        if self.num_heads is not None:
            heads = f"heads: {self.num_heads}"
            if self.num_kv_heads is not None and self.num_kv_heads != self.num_heads:
                heads += f" (kv {self.num_kv_heads})"
            heads += f" from {self.sources['heads']}"
        tied = ", ".join(f"{a} = {b}" for a, b in self.tied) or "none"
        return f"{blocks} | {plan} | {heads} | tied: {tied}"


def find_structure(model: nn.Module, spec: ModelSpec | None = None) -> ModelStructure:
    """Read ``model``'s structure: ``spec`` first, then what the model declares, then
    conventions (module docstring). Nothing is changed."""
    spec = spec or ModelSpec()
    sources: dict[str, str] = {}
    blocks_fqn, keys, block_class = _find_blocks(model, spec, sources)
    before, after = _ends_of(model, spec, blocks_fqn, sources)
    pp_plan = _declared(model, "_pp_plan")
    heads, kv = _find_heads(model, spec, sources)
    plan, plan_source = _find_tp_plan(model, spec, blocks_fqn)
    if plan is not None:
        sources["tp_modules"] = str(len(matching_modules(model, plan)))
    return ModelStructure(
        blocks_fqn=blocks_fqn,
        n_blocks=len(keys),
        block_class=block_class,
        block_keys=tuple(keys),
        before=before,
        after=after,
        tied=_find_tied(model, spec),
        num_heads=heads,
        num_kv_heads=kv,
        tp_plan=plan,
        tp_plan_source=plan_source,
        family=_family(model, spec),
        split_points=tuple(spec.split_points),
        pp_plan=pp_plan,
        fused_qkv=_find_fused_qkv(model, blocks_fqn),
        model_class=type(model).__name__,
        sources=sources,
        example_input=spec.example_input,
    )


def is_hf_model(model: nn.Module) -> bool:
    """A Hugging Face transformers model: its class comes from the transformers package."""
    return type(model).__module__.startswith("transformers.")


def _family(model: nn.Module, spec: ModelSpec) -> str:
    if spec != ModelSpec():
        return "user"
    if is_hf_model(model):
        return "hf"
    if type(model).__module__.startswith("meshrun.demo"):
        return "demo"
    names = {n for n, _ in model.named_modules()}
    if {"transformer.wte", "transformer.h", "lm_head"} <= names:
        return "nanogpt"
    return "generic"


def _declared(model: nn.Module, attr: str) -> dict[str, Any] | None:
    value = getattr(model, attr, None)
    return dict(value) if isinstance(value, Mapping) and value else None


# --- blocks --------------------------------------------------------------------------------


def _children(container: nn.Module) -> list[tuple[str, nn.Module]]:
    if isinstance(container, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return list(container.named_children())
    return []


def _find_blocks(
    model: nn.Module, spec: ModelSpec, sources: dict[str, str]
) -> tuple[str | None, list[str], str]:
    """(FQN of the block container, its children's keys, the block class name)."""
    if spec.blocks is not None:
        try:
            container = model.get_submodule(spec.blocks)
        except AttributeError:
            container = None
        kids = _children(container) if container is not None else []
        if not kids:
            raise ConfigError(
                f"ModelSpec(blocks={spec.blocks!r}): {type(model).__name__} has no "
                "nn.ModuleList/ModuleDict/Sequential of that name; pass the FQN of the list "
                f"of repeated blocks, one of {_candidate_lists(model) or 'none found'}"
            )
        sources["blocks"] = "ModelSpec.blocks"
        return spec.blocks, [k for k, _ in kids], _class_names(kids)
    declared = getattr(model, "_no_split_modules", None)
    found = _list_of(model, set(declared or ()))
    if found is not None:
        sources["blocks"] = "_no_split_modules"
        return found
    found = _list_of(model, None)
    if found is not None:
        sources["blocks"] = "convention: list of identical blocks"
        return found
    return None, [], ""


def _class_names(kids: list[tuple[str, nn.Module]]) -> str:
    return "/".join(sorted({type(m).__name__ for _, m in kids}))


def _list_of(model: nn.Module, classes: set[str] | None) -> tuple[str, list[str], str] | None:
    """The first container whose children are all of one class (of ``classes`` when given):
    conventional names first, then the longest such list."""
    best: tuple[int, int, str, list[tuple[str, nn.Module]]] | None = None
    for name, module in model.named_modules():
        kids = _children(module)
        kinds = {type(m).__name__ for _, m in kids}
        if len(kinds) != 1 or (classes is not None and not kinds & classes):
            continue
        conventional = name.rpartition(".")[2] in BLOCK_LIST_NAMES
        if classes is None and len(kids) < 2 and not conventional:
            continue  # one module in an unnamed container is no evidence of a block list
        rank = (int(conventional), len(kids))
        if best is None or rank > best[:2]:
            best = (*rank, name, kids)
    if best is None:
        return None
    return best[2], [k for k, _ in best[3]], _class_names(best[3])


def _candidate_lists(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n and _children(m)][:8]


def _ends_of(
    model: nn.Module, spec: ModelSpec, blocks_fqn: str | None, sources: dict[str, str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What runs before and after the blocks: the user's (checked), else the registration
    order (:func:`_around`)."""
    before, after = _around(model, blocks_fqn)
    for key, given in (("before", spec.before), ("after", spec.after)):
        if given is None:
            continue
        names = {n for n, _ in model.named_modules()}
        bad = [f for f in given if f not in names or f == blocks_fqn]
        if bad or (key == "before" and not given):
            raise ConfigError(
                f"ModelSpec({key}={tuple(given)!r}): {bad or 'empty'} is not a module of "
                f"{type(model).__name__} outside its blocks; give the FQNs of the modules that "
                f"run {key} the blocks, in forward order (registration order: "
                f"{list(before + after) or 'none'})"
            )
        sources["ends"] = "ModelSpec"
    return (
        tuple(before if spec.before is None else spec.before),
        tuple(after if spec.after is None else spec.after),
    )


def _around(model: nn.Module, blocks_fqn: str | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modules registered before and after the blocks on the path from the root to them
    (registration order: the forward order of nanoGPT, Llama, torchtitan and the demo); after
    the blocks the inner modules come first (``model.norm`` before ``lm_head``)."""
    if not blocks_fqn:
        return (), ()
    before: list[str] = []
    after: list[list[str]] = []
    module, prefix = model, ""
    for part in blocks_fqn.split("."):
        names = [name for name, _ in module.named_children()]
        at = names.index(part)
        before += [prefix + n for n in names[:at]]
        after.insert(0, [prefix + n for n in names[at + 1 :]])
        module, prefix = module.get_submodule(part), prefix + part + "."
    return tuple(before), tuple(fqn for level in after for fqn in level)


# --- heads, tied parameters, fused projections ---------------------------------------------


def _find_heads(
    model: nn.Module, spec: ModelSpec, sources: dict[str, str]
) -> tuple[int | None, int | None]:
    if spec.num_heads is not None:
        sources["heads"] = "ModelSpec"
        return spec.num_heads, spec.num_kv_heads or spec.num_heads
    config = getattr(model, "config", None)
    for where, obj in (("config", config), *((n or "model", m) for n, m in model.named_modules())):
        heads = _int_attr(obj, HEAD_ATTRS)
        if heads is not None:
            sources["heads"] = f"{where}.{heads[0]}"
            kv = _int_attr(obj, KV_HEAD_ATTRS)
            return heads[1], kv[1] if kv is not None else heads[1]
    return None, None


def _int_attr(obj: object, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        value = getattr(obj, name, None) if obj is not None else None
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return None


def _find_tied(model: nn.Module, spec: ModelSpec) -> tuple[tuple[str, str], ...]:
    """Pairs of parameter FQNs that are one tensor object (``spec.tied`` is checked, not
    trusted: a pair that is not one tensor would be trained untied)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    found = tuple((group[0], other) for group in names.values() for other in group[1:])
    for a, b in spec.tied or ():
        if (a, b) not in found and (b, a) not in found:
            raise ConfigError(
                f"ModelSpec(tied=(({a!r}, {b!r}),)): these are not one tensor in "
                f"{type(model).__name__} (tied pairs found: {list(found) or 'none'}); tie them "
                "in the model (b.weight = a.weight) or leave them out of the spec"
            )
    return found


def _find_fused_qkv(model: nn.Module, blocks_fqn: str | None) -> tuple[str, ...]:
    """Projections inside the blocks that compute q, k and v in one matrix (nanoGPT's and
    GPT-2's ``c_attn``, ``qkv``, ``Wqkv``): column-wise splitting them gives a rank a slice
    of q and k, not whole heads."""
    if blocks_fqn is None:
        return ()
    fused = ("c_attn", "qkv", "wqkv", "qkv_proj", "in_proj")
    return tuple(
        name
        for name, _ in model.named_modules()
        if name.startswith(blocks_fqn + ".") and name.rpartition(".")[2].lower() in fused
    )


# --- the tensor-parallel plan ----------------------------------------------------------------


def _find_tp_plan(
    model: nn.Module, spec: ModelSpec, blocks_fqn: str | None
) -> tuple[dict[str, Any] | None, str]:
    if spec.tp_plan is not None:
        return dict(spec.tp_plan), "ModelSpec.tp_plan"
    plan = _declared(model, "_tp_plan")
    if plan is not None and any("." in k for k in plan):
        return plan, "_tp_plan"
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) if is_hf_model(model) else None
    prefix = getattr(model, "base_model_prefix", "")
    if isinstance(base, Mapping) and base:
        has_base = prefix and isinstance(getattr(model, prefix, None), nn.Module)
        full = {(f"{prefix}.{k}" if has_base else k): v for k, v in base.items()}
        return full | (plan or {}), "config.base_model_tp_plan"
    convention = convention_tp_plan(model, blocks_fqn)
    if convention:
        return convention, "convention: linear-layer names"
    return None, ""


# Last names of nn.Linear layers in common blocks (Llama, torchtitan, nanoGPT, the demo):
# q/k/v and the MLP's up/gate column-wise, the attention output and the MLP's down row-wise
# (Megatron-LM's layout: one all-reduce after attention, one after the MLP).
COLWISE = {"q", "k", "v", "q_proj", "k_proj", "v_proj", "wq", "wk", "wv"}
COLWISE |= {"up", "gate", "up_proj", "gate_proj", "w1", "w3", "fc1", "c_fc"}
ROWWISE = {"proj", "o_proj", "wo", "out_proj", "down", "down_proj", "w2", "fc2", "c_proj"}


def convention_tp_plan(model: nn.Module, blocks_fqn: str | None) -> dict[str, str]:
    """HF-style plan strings for the recognised ``nn.Linear`` layers inside the blocks."""
    plan: dict[str, str] = {}
    if blocks_fqn is None:
        return plan
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or not name.startswith(blocks_fqn + "."):
            continue
        last = name.rpartition(".")[2]
        if last in COLWISE | ROWWISE:
            plan[name] = "colwise" if last in COLWISE else "rowwise"
    return plan


def matching_modules(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """Module FQN -> the plan value of the pattern that names it (``*`` matches one name, as
    DTensor's ``parallelize_module``); the last matching pattern wins, as there."""
    import fnmatch

    out: dict[str, Any] = {}
    for name, _ in model.named_modules():
        parts = name.split(".")
        for pattern, value in plan.items():
            pats = pattern.split(".")
            if len(parts) == len(pats) and all(map(fnmatch.fnmatchcase, parts, pats)):
                out[name] = value
    return out
