"""Context parallel (``parallel.cp``): each sample's sequence split over the ``cp`` ranks, with
attention over the whole sequence by an all-to-all head scatter (Ulysses-style).

The ``cp`` ranks of one data-parallel rank read the same batch; the step loop hands each its
slice of the sequence (:func:`shard_sequence`: rank ``r`` of ``cp`` gets tokens ``r*S/cp ..``
of every ``[B, S, ...]`` tensor). Everything outside attention (embeddings, MLPs, norms, the
head, the loss) works per token, so it runs on the slice unchanged: activations there are
``S/cp`` long. Attention needs every earlier token, so around it the split is swapped::

    q, k, v [B, H, S/cp, D] --all_to_all--> [B, H/cp, S, D] --causal SDPA--> --all_to_all--> [B, H, S/cp, D]

Why not torch's ring attention (``torch.distributed.tensor.experimental.context_parallel``): in
torch 2.13 it shards only the CUDA SDPA kernels (flash, efficient, cuDNN); on CPU it fails (no
sharding rule for ``aten._scaled_dot_product_flash_attention_for_cpu``; with the math kernel a
plain mask meets DTensors). The all-to-all runs on Gloo and NCCL alike, with any SDPA kernel.

Positions: a forward pre-hook on the model passes each slice's *global* ``position_ids``
(RoPE and learned positions then see the token's place in the whole sequence). Loss and
gradients: each cp rank's loss is the mean over its slice, and DDP / FSDP2 average the
gradients over ``dp x cp`` (``dp_cp`` / ``dp_shard_cp``, runtime/mesh.py). The all-to-all's
backward sends each rank's share of the gradient to the rank whose activations made it, so
that average is the gradient of the whole sequence's mean loss whenever every slice counts
the same number of targets; :func:`sequence_cross_entropy` is exact also when they do not
(targets ``-100``).
"""

from __future__ import annotations

import inspect
import math
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun.config import ConfigError
from meshrun.parallel.structure import ModelStructure

ATTN_KEY = "meshrun_cp"  # the name registered in transformers' AttentionInterface
IGNORE = -100  # the target cross-entropy skips (torch's and Hugging Face's default)
SDPA_ATTR = "sdpa"  # the seam of a model of one's own: module.sdpa(q, k, v, dropout_p=, is_causal=)
_UNSUPPORTED_KWARGS = ("sliding_window", "softcap", "s_aux", "position_bias")
_NO_MASK = "context parallel supports causal attention without a mask (no padding, no packing)"


def cp_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """The ``cp`` dim's process group, or None when the mesh has none (cp = 1)."""
    if mesh is None or "cp" not in (mesh.mesh_dim_names or ()):
        return None
    return mesh.get_group("cp")


# ---- the differentiable all-to-all and the attention --------------------------------------


class _AllToAll(torch.autograd.Function):
    """Split ``x`` into cp chunks along ``scatter_dim``, send chunk j to rank j, concatenate
    what arrives (in rank order) along ``gather_dim``; the gradient is the same exchange with
    the dims swapped. (``torch.distributed.nn.functional.all_to_all_single`` is deprecated in
    2.13 and knows no dims.)"""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int
    ) -> Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _all_to_all(x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    cp = dist.get_world_size(group)
    # Stacked, the chunks have "destination rank" first: the layout all_to_all_single splits.
    send = torch.stack([c.contiguous() for c in x.chunk(cp, dim=scatter_dim)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def exchange(x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """The differentiable all-to-all over ``group`` (see :class:`_AllToAll`)."""
    return cast(Tensor, _AllToAll.apply(x, group, scatter_dim, gather_dim))


def check_heads(num_heads: int, num_kv_heads: int, cp: int) -> int:
    """Refuse heads the cp ranks cannot split; return how often each key/value head is repeated
    before the exchange: cp / gcd(kv heads, cp), the fewest copies that divide by cp."""
    if num_heads % cp:
        raise ConfigError(
            f"parallel.cp = {cp}: context parallel gives each cp rank whole attention heads, "
            f"but the model has {num_heads} heads; choose a cp that divides {num_heads}"
        )
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"{num_heads} query heads are not a multiple of {num_kv_heads} key/value heads"
        )
    return cp // math.gcd(num_kv_heads, cp)


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Causal attention over the whole sequence for q ``[B, H, S/cp, D]`` and k, v
    ``[B, Hkv, S/cp, D]`` (rank r holds tokens ``r*S/cp ..``); returns ``[B, H, S/cp, D]``."""
    repeat = check_heads(q.shape[1], k.shape[1], dist.get_world_size(group))
    if repeat > 1:  # repeat_interleave keeps kv head j next to the query heads that use it
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    # Rank r receives query heads r*H/cp.. and kv heads r*Hkv'/cp..: the kv heads of exactly
    # those query heads, so grouped-query attention keeps its grouping.
    q, k, v = (exchange(t, group, 1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        scale=scale,
        dropout_p=dropout_p,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return exchange(out, group, 2, 1)


def _sdpa_seam(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    group: dist.ProcessGroup,
) -> Tensor:
    """What replaces a module's ``sdpa`` (F.scaled_dot_product_attention's signature)."""
    if attn_mask is not None or not is_causal:
        raise ConfigError(f"{_NO_MASK}: call sdpa(q, k, v, is_causal=True) without attn_mask")
    return ulysses_attention(q, k, v, group, scale=scale, dropout_p=dropout_p)


def hf_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    group: dist.ProcessGroup,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' AttentionInterface signature: returns ``[B, S/cp, H, D]``. transformers
    builds no mask for an implementation it has no mask function for, so ``attention_mask`` is
    None unless the caller passed a 4-D one: refused, as is any feature causal attention over
    the whole sequence would silently drop."""
    if attention_mask is not None:
        raise ConfigError(_NO_MASK)
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ConfigError(f"context parallel does not support attention with {name}")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise ConfigError(f"{type(module).__name__} is not causal: context parallel needs it")
    out = ulysses_attention(query, key, value, group, scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


# ---- hooking a model ------------------------------------------------------------------------


def apply_cp(model: nn.Module, mesh: DeviceMesh, structure: ModelStructure) -> str:
    """Make ``model``'s attention span the ``cp`` ranks, in place, before any other layout:
    a Hugging Face model through transformers' AttentionInterface, a model of one's own through
    its modules' ``sdpa`` attribute (the demo's ``Attention``); then a forward pre-hook passes
    global ``position_ids``. Refuses (ConfigError, the same on every rank, before step 1) a
    model it cannot hook, heads cp cannot split, non-full attention. Returns how it hooked."""
    group = mesh.get_group("cp")
    cp = group.size()
    if structure.num_heads is not None:
        check_heads(structure.num_heads, structure.num_kv_heads or structure.num_heads, cp)
    how = _hook_hf(model, group, cp) if _is_hf(model) else _hook_sdpa(model, group, structure)
    _check_positions(model)
    model.register_forward_pre_hook(partial(_global_positions, group=group), with_kwargs=True)
    return how


def _is_hf(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _hook_hf(model: nn.Module, group: dist.ProcessGroup, cp: int) -> str:
    from transformers import AttentionInterface

    name, hf = type(model).__name__, cast(Any, model)  # a PreTrainedModel (_is_hf)
    # transformers' own test of a swappable attention: the modeling file has an *Attention
    # module and calls ALL_ATTENTION_FUNCTIONS.get_interface (Bloom, Falcon, MPT do not).
    if not type(hf)._can_set_attn_implementation():
        raise ConfigError(
            f"parallel.cp = {cp}: {name}'s attention does not go through transformers' "
            f"AttentionInterface ({type(model).__module__}), so context parallel cannot hook "
            "it; set parallel.cp=1"
        )
    config = hf.config.get_text_config()
    other = sorted({t for t in getattr(config, "layer_types", None) or [] if t != "full_attention"})
    if other or (
        getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    ):
        raise ConfigError(
            f"parallel.cp = {cp}: context parallel supports full causal attention only; {name} "
            f"has {other or 'sliding-window'} attention; set parallel.cp=1"
        )
    # Registered per group: one cp group per process, re-registering replaces it.
    AttentionInterface.register(ATTN_KEY, partial(hf_attention, group=group))
    hf.set_attn_implementation(ATTN_KEY)
    if hf.config._attn_implementation != ATTN_KEY:
        raise ConfigError(f"{name} did not take attn_implementation={ATTN_KEY!r}")
    return f"transformers attention {ATTN_KEY!r}"


def _hook_sdpa(model: nn.Module, group: dist.ProcessGroup, structure: ModelStructure) -> str:
    seams = [m for m in model.modules() if callable(getattr(m, SDPA_ATTR, None))]
    if not seams:
        raise ConfigError(
            f"parallel.cp = {group.size()}: {type(model).__name__} is neither a transformers "
            f"model nor has modules whose attention calls self.{SDPA_ATTR}(q, k, v, "
            "is_causal=True) (the seam meshrun.demo.model.Attention shows), so context parallel "
            "cannot reach its attention; add that seam or set parallel.cp=1"
        )
    if structure.num_heads is None:
        raise ConfigError(
            f"parallel.cp = {group.size()}: cannot find {type(model).__name__}'s head count "
            "(an n_head / num_heads attribute or ModelSpec); context parallel must check it"
        )
    fn = partial(_sdpa_seam, group=group)
    for m in seams:
        setattr(m, SDPA_ATTR, fn)
    return f"{len(seams)} attention modules' {SDPA_ATTR}"


def _check_positions(model: nn.Module) -> None:
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ConfigError(
            f"context parallel: {type(model).__name__}.forward takes no position_ids, so each "
            "rank's slice would be numbered from 0; add a position_ids argument (see "
            "meshrun.demo.model.GPT) or set parallel.cp=1"
        )


def _global_positions(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, group: dist.ProcessGroup
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook: ``position_ids`` of this rank's slice in the whole sequence, unless
    the caller gave them; refuses a padding mask and Hugging Face's ``labels`` loss."""
    if kwargs.get("labels") is not None:
        raise ConfigError(
            "context parallel: labels= makes the model shift the targets inside each rank's "
            "slice; pass targets shifted on the whole sequence and compute the loss outside "
            "(meshrun.parallel.cp.sequence_cross_entropy, docs/parallel.md)"
        )
    _refuse_padding(kwargs.get("attention_mask"), group)
    if kwargs.get("position_ids") is None:
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if not isinstance(ids, Tensor):
            raise ConfigError("context parallel: cannot find the input ids to number")
        n = ids.shape[1]
        kwargs["position_ids"] = (torch.arange(n, device=ids.device) + dist.get_rank(group) * n)[
            None
        ]
    return args, kwargs


def _refuse_padding(mask: Tensor | None, group: dist.ProcessGroup) -> None:
    # transformers builds no mask for our implementation, so padding would be dropped silently.
    # The ranks agree first: only one slice may hold the padding.
    if mask is None:
        return
    ok = torch.tensor([int(bool(mask.all()))], device=mask.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not ok.item():
        raise ConfigError(_NO_MASK)


# ---- the batch and the loss -----------------------------------------------------------------


def shard_sequence(batch: Any, group: dist.ProcessGroup) -> Any:
    """This rank's slice of ``batch`` along dim 1 (the sequence): every tensor with 2 or more
    dims in a (nested) tensor / dict / list / tuple, which must share one length S that
    divides by cp; other values pass unchanged."""
    cp, rank = group.size(), dist.get_rank(group)
    lengths = _lengths(batch)
    if len(lengths) > 1:
        raise ConfigError(
            f"context parallel splits dim 1 of every batch tensor, but they have lengths "
            f"{sorted(lengths)}; give every [B, S, ...] tensor the same sequence length"
        )
    if lengths and next(iter(lengths)) % cp:
        s = next(iter(lengths))
        raise ConfigError(
            f"sequence length {s} does not divide by parallel.cp = {cp}; make it a multiple of "
            f"{cp} (e.g. {s - s % cp} or {s + cp - s % cp})"
        )
    return _slice(batch, rank, cp)


def _lengths(batch: Any) -> set[int]:
    if isinstance(batch, Tensor):
        return {int(batch.shape[1])} if batch.dim() >= 2 else set()
    if isinstance(batch, (dict, list, tuple)):
        values = batch.values() if isinstance(batch, dict) else batch
        return set().union(*(_lengths(v) for v in values))
    return set()


def _slice(batch: Any, rank: int, cp: int) -> Any:
    if isinstance(batch, Tensor):
        return batch.chunk(cp, dim=1)[rank] if batch.dim() >= 2 else batch
    if isinstance(batch, dict):
        return {k: _slice(v, rank, cp) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, rank, cp) for v in batch)
    return batch


def sequence_cross_entropy(logits: Tensor, targets: Tensor, mesh: DeviceMesh | None) -> Tensor:
    """Cross-entropy averaged over every counted target of the whole sequences (``-100``
    skipped), for any ``parallel.cp``: its value is that mean on every cp rank, and its
    gradient is the one the ``dp x cp`` average of DDP / FSDP2 turns into the whole sequence's.
    With cp = 1 it is ``F.cross_entropy(logits.flatten(0, -2), targets.flatten())``.

    Why: each slice may count a different number of targets, so the plain per-rank mean
    weights them wrongly; here rank r backprops ``cp x (its loss sum) / N`` (N counted over the
    cp ranks), whose average over the cp ranks is the whole sequences' mean."""
    flat = logits.flatten(0, -2).float()
    group = cp_group(mesh)
    if group is None:
        return F.cross_entropy(flat, targets.flatten(), ignore_index=IGNORE)
    total = F.cross_entropy(flat, targets.flatten(), ignore_index=IGNORE, reduction="sum")
    stats = torch.stack([total.detach(), (targets != IGNORE).sum().to(total.dtype)])
    dist.all_reduce(stats, group=group)
    count = stats[1].clamp(min=1)
    part = total * (group.size() / count)
    return part + (stats[0] / count - part).detach()  # the value: the whole sequences' mean
