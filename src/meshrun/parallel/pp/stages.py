"""Pipeline stage modules for any model whose structure is known: the parts before the blocks
(embeddings), a run of blocks, the parts after them (final norm, head), under the whole
model's names.

A stage holds the model's own submodules at their own FQNs (``model.layers.3``,
``transformer.h.0``, ``lm_head``), so its state_dict keys, TP plan patterns and FSDP block
names are the unsplit model's. Its forward rebuilds what the model's forward does around the
blocks:

- first stage: the first ``nn.Embedding`` before the blocks takes the token ids, every other
  ``nn.Embedding`` there is a position table added at ``arange(T)`` (GPT-2, nanoGPT, the demo),
  the remaining modules (dropout, an embedding norm) run after the sum, in order;
- each block: ``block(x)``, or for Hugging Face decoder layers ``block(hidden_states,
  attention_mask=causal mask, position_ids=..., position_embeddings=rotary cos/sin)``: the mask
  and rotary embeddings are made on every stage from its input, with transformers' own masking
  functions (:mod:`transformers.masking_utils`) and the model's own ``rotary_emb``. (Under eager
  attention a decoder layer given ``attention_mask=None`` attends to every position: a
  different, non-causal model.)
- last stage: the modules after the blocks, in order.

Because that is a reconstruction, :func:`check_stages_reproduce` runs every stage in a row on
a probe batch before training and refuses the split when it does not give the model's own
logits (a model whose forward does more, e.g. scales its embeddings, is refused, not trained
differently). A model on the meta device has no values: both run on fake tensors and the shapes
and dtypes of their logits are compared, and the start-up line says that only they were. That
check runs in the precision the stages will compute in (``parallel.param_dtype`` under
autocast): fake tensors run torch's meta kernels, and some take the low precision only (the
grouped expert matmul of transformers' MoE models takes bf16).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from meshrun.config import ConfigError

__all__ = ["StageModule", "StageParts", "check_stages_reproduce", "hf_context"]


@dataclass(frozen=True)
class StageParts:
    """What one stage runs, by the whole model's FQNs."""

    before: tuple[str, ...]  # first stage only: embeddings, dropout
    blocks: tuple[str, ...]  # this stage's blocks, in order
    after: tuple[str, ...]  # last stage only: final norm, head
    shared: tuple[str, ...] = ()  # on every stage, never called directly (rotary embeddings)

    @property
    def fqns(self) -> tuple[str, ...]:
        return self.before + self.blocks + self.after + self.shared


# Per-block keyword arguments for one stage input (Hugging Face decoder layers), or None.
# Arguments: the stage's input, the stage module, its block FQNs.
BlockKwargs = Callable[[Tensor, nn.Module, Sequence[str]], list[dict[str, Any]]]


def _attach(root: nn.Module, fqn: str, module: nn.Module) -> None:
    """Register ``module`` under ``root`` at ``fqn``, creating plain containers on the way."""
    *path, leaf = fqn.split(".")
    node = root
    for name in path:
        child = node._modules.get(name)
        if child is None:
            child = nn.ModuleDict()
            node.add_module(name, child)
        node = child
    node.add_module(leaf, module)


class StageModule(nn.Module):
    """One pipeline stage: the model's submodules named in ``parts``, at their own FQNs."""

    def __init__(
        self, model: nn.Module, parts: StageParts, block_kwargs: BlockKwargs | None = None
    ) -> None:
        super().__init__()
        for fqn in parts.fqns:
            _attach(self, fqn, model.get_submodule(fqn))
        self.meshrun_parts = parts  # read by checkpoint's PipelineView (checkpoint/pipeline.py)
        self.meshrun_hf_source: Any = (
            None  # a transformers model's class and configs (parallel/pp/pipeline.py)
        )
        self.is_first = bool(parts.before)
        self.is_last = bool(parts.after)
        self._block_kwargs = block_kwargs

    def forward(self, x: Tensor) -> Tensor:
        part = self.get_submodule
        if self.is_first:
            x = _embed(x, [part(f) for f in self.meshrun_parts.before])
        blocks = [part(f) for f in self.meshrun_parts.blocks]
        fqns = self.meshrun_parts.blocks
        kwargs = self._block_kwargs(x, self, fqns) if self._block_kwargs else [{}] * len(fqns)
        for block, kw in zip(blocks, kwargs, strict=True):
            out = block(x, **kw)
            x = out[0] if isinstance(out, tuple) else out  # older HF layers return tuples
        for f in self.meshrun_parts.after:
            x = part(f)(x)
        return x


def _embed(ids: Tensor, modules: Sequence[nn.Module]) -> Tensor:
    """The first embedding on the ids, further embeddings as position tables, then the rest."""
    embeddings = [m for m in modules if isinstance(m, nn.Embedding)]
    x = embeddings[0](ids)
    if len(embeddings) > 1:
        pos = torch.arange(ids.shape[1], device=ids.device)
        for table in embeddings[1:]:
            x = x + table(pos)
    for m in modules:
        if not isinstance(m, nn.Embedding):
            x = m(x)
    return x


# --- Hugging Face decoder layers: mask and rotary embeddings on every stage -----------------


def _mask_kwargs(fn: Callable[..., Any], config: Any, h: Tensor, pos: Tensor) -> dict[str, Any]:
    """Arguments for a transformers masking function, across its recent signatures. An
    optional argument is passed only when it is the current one: transformers keeps a renamed
    or retired one in the signature for a while and warns (FutureWarning) when it is given,
    even as None (``past_key_values`` -> ``cache``; ``cache_position`` -> ``position_ids``)."""
    params = inspect.signature(fn).parameters

    def required(name: str) -> bool:
        return name in params and params[name].default is inspect.Parameter.empty

    kw: dict[str, Any] = {"config": config, "inputs_embeds": h, "attention_mask": None}
    for name in ("cache", "past_key_values"):  # no cache: None, needed only where required
        if required(name):
            kw[name] = None
            break
    # The stage's positions are arange(T) (one unpacked sequence per row): where position_ids
    # is optional it is left out, as the model's own forward leaves it, so transformers skips
    # its packed-sequence check (a host sync per call on a GPU; on fake tensors, where it
    # cannot read values, a materialized mask the real run does not build: memory_trace.py).
    if required("position_ids"):
        kw["position_ids"] = pos
    if required("cache_position") or ("cache_position" in params and "position_ids" not in params):
        kw["cache_position"] = pos[0]
    return kw


def hf_context(model: nn.Module, blocks: Sequence[str]) -> tuple[BlockKwargs, tuple[str, ...]]:
    """Per-block kwargs for a transformers model's decoder layers (causal mask of each layer's
    attention type, position ids, rotary cos/sin) and the FQN of its rotary module, if any."""
    from transformers import masking_utils

    config = model.config
    makers: dict[str, Callable[..., Any]] = {
        "full_attention": masking_utils.create_causal_mask,
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
    }
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(blocks))
    index = {fqn: int(fqn.rpartition(".")[2]) for fqn in blocks}
    unknown = sorted({layer_types[i] for i in index.values()} - set(makers))
    if unknown:
        raise ConfigError(
            f"parallel.pp: {type(model).__name__}'s config.layer_types has {unknown}; meshrun "
            f"builds stage masks for {sorted(makers)} only; set parallel.pp=1 for this model"
        )
    used = {t: makers[t] for t in {layer_types[i] for i in index.values()}}
    rotary = _rotary_fqn(model)

    def block_kwargs(h: Tensor, stage: nn.Module, fqns: Sequence[str]) -> list[dict[str, Any]]:
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        masks = {t: fn(**_mask_kwargs(fn, config, h, pos)) for t, fn in used.items()}
        common: dict[str, Any] = {"position_ids": pos}
        if rotary:
            common["position_embeddings"] = stage.get_submodule(rotary)(h, pos)
        return [{"attention_mask": masks[layer_types[index[f]]], **common} for f in fqns]

    return block_kwargs, (rotary,) if rotary else ()


def _rotary_fqn(model: nn.Module) -> str:
    names = [n for n, _ in model.named_modules() if n.rpartition(".")[2] == "rotary_emb"]
    if len(names) > 1:
        raise ConfigError(
            f"parallel.pp: {type(model).__name__} has {len(names)} rotary embedding modules "
            f"({', '.join(names)}); meshrun's stages compute one on every stage"
        )
    return names[0] if names else ""


# --- the check that the stages are the model ------------------------------------------------


def _logits(out: Any) -> Tensor:
    if isinstance(out, tuple):
        out = out[0]
    logits = getattr(out, "logits", out)
    if not isinstance(logits, Tensor):
        raise TypeError(f"the model returned {type(out).__name__}, not logits")
    return logits


def _probe_ids(first: StageModule) -> Tensor:
    before = [first.get_submodule(f) for f in first.meshrun_parts.before]
    embeddings = [m for m in before if isinstance(m, nn.Embedding)]
    vocab = embeddings[0].num_embeddings
    length = min([8, *(e.num_embeddings for e in embeddings[1:])])
    device = embeddings[0].weight.device
    g = torch.Generator().manual_seed(0)  # never the global RNG: training must not see this
    return torch.randint(0, vocab, (2, length), generator=g).to(device)


def _run_both(model: nn.Module, stages: Sequence[StageModule]) -> tuple[Tensor, Tensor]:
    """The model's logits and the stages' (in a row) on a probe batch, eval mode, no grad."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids = _probe_ids(stages[0])
            try:
                want = _logits(model(ids))
            except Exception as e:  # the model needs more than ids: nothing to compare with
                raise ConfigError(
                    f"parallel.pp: {type(model).__name__}(input_ids) failed ({e}), so meshrun "
                    "cannot check that its pipeline stages compute the model's forward; pass a "
                    "model whose forward takes token ids alone"
                ) from e
            x = ids
            for stage in stages:
                x = stage(x)
    finally:
        model.train(was_training)
    return x, want


class _Both(nn.Module):
    """The model (a child, so that ``functional_call`` can swap its tensors) and its stages
    (which hold the same submodules), run by :func:`_run_both`."""

    def __init__(self, model: nn.Module, stages: Sequence[StageModule]) -> None:
        super().__init__()
        self.model = model
        self.__dict__["stages"] = stages  # not children: their tensors are the model's

    def forward(self) -> tuple[Tensor, Tensor]:
        return _run_both(self.model, self.__dict__["stages"])


def _check_shapes_on_meta(
    model: nn.Module,
    stages: Sequence[StageModule],
    compute: contextlib.AbstractContextManager | None = None,
) -> str:
    """A meta model has no values: run both on fake tensors (shapes and dtypes only; under
    FakeTensorMode transformers skips its data-dependent mask checks, which plain meta tensors
    cannot answer) and compare what comes out. The fake tensors are on the CPU, not meta, and
    run under ``compute`` (the run's autocast): autocast's dispatch is per device, and meta has
    none, so on meta the check would compute in fp32 whatever the run computes in."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), compute or contextlib.nullcontext():
        both = _Both(model, stages)
        state = {**dict(both.named_parameters()), **dict(both.named_buffers())}
        fake = {k: torch.empty_like(v, device="cpu") for k, v in state.items()}
        x, want = torch.func.functional_call(both, fake, ())
    if (tuple(x.shape), x.dtype) != (tuple(want.shape), want.dtype):
        raise ConfigError(
            f"parallel.pp: {type(model).__name__}'s pipeline stages give logits of shape "
            f"{tuple(x.shape)} {x.dtype} on a probe batch, its forward {tuple(want.shape)} "
            f"{want.dtype}: {_does_more(stages)}"
        )
    return (
        f"shapes only ({list(want.shape)}): the model is on the meta device, so no values "
        "can be compared; the stages are the same code as for the model built on a real "
        "device, where its values are compared, and they depend on the model's class and "
        "structure, not on its weights or sizes: to check a model class of your own, build it "
        "once on a real device (a smaller config is enough)"
    )


def _does_more(stages: Sequence[StageModule]) -> str:
    """Why the stages differ from the forward, and what can be done: the stages rebuild a
    plain chain of the model's modules; arithmetic or arguments in the forward between them
    are not modules, so no ModelSpec can describe them."""
    first, last = stages[0].meshrun_parts, stages[-1].meshrun_parts
    chain = " -> ".join([*first.before, f"{first.blocks[0].rpartition('.')[0]}.*", *last.after])
    return (
        f"its forward does more than the chain meshrun's stages rebuild ({chain}: the first "
        "embedding on the ids, further embeddings as position tables, each block on the hidden "
        "state alone, then the rest in order): work between these modules (a scale, a mask or "
        "other arguments passed to the blocks, a final log_softmax) is not a module, and no "
        "ModelSpec can describe it; move it into the modules (or into the loss), pass "
        "ModelSpec(before=..., after=...) if only the order of the chain is wrong, or set "
        "parallel.pp=1 (parallel.dp_shard shards the model without splitting its forward)"
    )


def check_stages_reproduce(
    model: nn.Module,
    stages: Sequence[StageModule],
    compute: contextlib.AbstractContextManager | None = None,
) -> str:
    """Run all stages in a row and the whole model on a probe batch (eval mode, no grad);
    refuse the split, before any training, if the logits differ. A model on the meta device
    is checked for shapes only, under ``compute`` (the run's precision: see
    :func:`_check_shapes_on_meta`). Returns what was checked, for the start-up line."""
    if any(p.is_meta for p in model.parameters()):
        return _check_shapes_on_meta(model, stages, compute)
    x, want = _run_both(model, stages)
    diff = float((x.float() - want.float()).abs().max()) if x.shape == want.shape else None
    scale = float(want.float().abs().max()) + 1e-6
    if diff is None or diff > 1e-4 * scale:
        got = f"shape {tuple(x.shape)} vs {tuple(want.shape)}" if diff is None else f"{diff:.3g}"
        raise ConfigError(
            f"parallel.pp: {type(model).__name__}'s pipeline stages (embeddings -> blocks -> "
            f"norm/head) do not reproduce its forward on a probe batch (max |logit difference| "
            f"{got}, logits up to {scale:.3g}): {_does_more(stages)}"
        )
    return f"values on a probe batch (max |logit difference| {diff:.2g})"
