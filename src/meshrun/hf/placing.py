"""The model side of a pretrained load: its tensors by name, their ties, the region of the whole
tensor each rank holds, and the allocation of a model still on the meta device.

- A DTensor parameter (FSDP2 / ZeRO-3 / HSDP ``Shard(0)``, tensor parallel ``Shard(0)`` /
  ``Shard(1)``, ``Replicate``, and their compositions) holds the box of the global tensor
  that torch's own ``compute_local_shape_and_global_offset`` gives for its mesh and placements
  (what DCP writes and reads for it); a plain tensor (DDP, ZeRO-1/2, a pipeline stage's) holds
  all of it.
- Parameters on the meta device are allocated with ``to_empty`` on the run's device (after
  sharding: each rank's shards only). Their non-persistent buffers (rotary ``inv_freq``) are not
  in any checkpoint, so they are recomputed by the model's own initialisation, the way
  transformers does after its meta-device load: a Hugging Face model's ``_init_weights`` on
  each module that holds one (it recomputes rotary tables from the config), else the model's
  ``init_weights()`` (meshrun's contract for meta-device models, as ``parallelize`` uses).
  They are filled with NaN first; one still NaN afterwards is an error naming it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.hf.names import PretrainedError, clean_name

__all__ = [
    "declared_ties",
    "ignored_unexpected",
    "local_region",
    "materialize_parts",
    "model_parts",
    "named_tensors",
]

Region = tuple[slice, ...]


def _unwrap(m: nn.Module) -> nn.Module:
    return m.module if isinstance(m, DDP) else m


def model_parts(model: Any) -> tuple[list[nn.Module], bool, list[tuple[str, str]]]:
    """``(modules, partial, tied)``: the modules to fill, whether this rank holds only part of
    the model (a pipeline), and tied pairs known from outside the modules (a pipeline's pairs
    across stages). A ``Pipeline`` is duck-typed (its ``modules`` list), as checkpoints do."""
    stages = getattr(model, "modules", None)
    if not isinstance(model, nn.Module) and isinstance(stages, list):
        tied = [tuple(c.pair.fqns) for c in getattr(model, "tied", [])]
        return [_unwrap(m) for m in stages], True, tied
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"load_pretrained(model, ...): got a {type(model).__name__}; pass the model "
            "(after run.parallelize) or the Pipeline from run.pipeline"
        )
    module = _unwrap(model)
    return [module], hasattr(module, "meshrun_parts"), []  # a pipeline StageModule: partial


def named_tensors(parts: Sequence[nn.Module]) -> dict[str, Tensor]:
    """Every parameter and persistent buffer under every name (tied ones under each), cleaned
    of wrapper components: the names a checkpoint of this model holds. FSDP2 units are
    resharded first: after a forward that kept them gathered (``reshard_after_forward`` off,
    the root's default) the modules hold the unsharded tensors, which FSDP2 overwrites."""
    out: dict[str, Tensor] = {}
    for part in parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        for path, m in part.named_modules(remove_duplicate=False):
            owned = [(n, t) for n, t in m._parameters.items() if t is not None]
            owned += [
                (n, t)
                for n, t in m._buffers.items()
                if t is not None and n not in m._non_persistent_buffers_set
            ]
            for name, t in owned:
                out[clean_name(f"{path}.{name}" if path else name)] = t
    return out


def declared_ties(parts: Sequence[nn.Module]) -> list[tuple[str, str]]:
    """Ties a Hugging Face model declares (``all_tied_weights_keys``: target -> source, set
    only when its config ties them, e.g. ``tie_word_embeddings``), under the part's names."""
    pairs = []
    for part in parts:
        for path, m in part.named_modules():
            tied = getattr(m, "all_tied_weights_keys", None)
            if isinstance(tied, dict):
                pre = clean_name(path) + "." if path else ""
                pairs += [(pre + str(src), pre + str(dst)) for dst, src in tied.items()]
    return pairs


def ignored_unexpected(parts: Sequence[nn.Module]) -> list[str]:
    """A Hugging Face model's ``_keys_to_ignore_on_load_unexpected`` (patterns it expects to
    find in older checkpoints and skips, e.g. per-layer ``rotary_emb.inv_freq``)."""
    found: list[str] = []
    for part in parts:
        for m in part.modules():
            found += list(getattr(m, "_keys_to_ignore_on_load_unexpected", None) or [])
    return found


def identity_ties(tensors: dict[str, Tensor]) -> list[tuple[str, str]]:
    """Names that are one tensor object (a tie that survived parallelization)."""
    first: dict[int, str] = {}
    pairs = []
    for name, t in tensors.items():
        if id(t) in first:
            pairs.append((first[id(t)], name))
        else:
            first[id(t)] = name
    return pairs


def alias_map(pairs: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Each tied name -> the other names of its group (groups joined through shared names)."""
    groups: list[set[str]] = []
    for a, b in pairs:
        joined = {a, b}
        rest = []
        for g in groups:
            if g & joined:
                joined |= g
            else:
                rest.append(g)
        groups = [*rest, joined]
    return {n: sorted(g - {n}) for g in groups for n in g}


def local_region(t: Tensor) -> tuple[Tensor, Region | None]:
    """The tensor this rank writes into and the region of the whole tensor it holds (None: all
    of it). Under ``no_grad`` ``to_local()`` is the local tensor itself (no copy)."""
    if not isinstance(t, DTensor):
        return t, None
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    with torch.no_grad():
        local = t.to_local()
    if tuple(local.shape) != tuple(shape):
        raise PretrainedError(
            f"a DTensor of {list(t.shape)} with placements {t.placements} holds a local "
            f"{list(local.shape)}, not the {list(shape)} torch computes for it: a layout "
            "load_pretrained cannot read into"
        )
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _is_meta(t: Tensor) -> bool:
    return t.device.type == "meta"


def materialize_parts(parts: Sequence[nn.Module], device: torch.device) -> int:
    """Allocate the parts still on the meta device and recompute their non-persistent buffers;
    returns how many parts were allocated. Ties hold afterwards: ``to_empty`` gives each
    module a tensor of its own (measured: a tied Llama's ``lm_head.weight`` and embeddings
    came out as two tensors), so every place that held one tensor is pointed at one again."""
    done = 0
    for part in parts:
        if not any(_is_meta(t) for t in (*part.parameters(), *part.buffers())):
            continue
        shared = _shared_slots(part)
        part.to_empty(device=device)
        for slots in shared:
            m0, n0 = slots[0]
            for m, n in slots[1:]:
                m._parameters[n] = m0._parameters[n0]
        _reinit_buffers(part)
        done += 1
    return done


def _shared_slots(part: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) places of each parameter held in more than one place."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in part.modules():
        for n, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((m, n))
    return [s for s in slots.values() if len(s) > 1]


def _holders(part: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (path, m)
        for path, m in part.named_modules()
        if any(n in m._non_persistent_buffers_set for n, b in m._buffers.items() if b is not None)
    ]


def _hf_owner(path: str, part: nn.Module) -> nn.Module | None:
    """The innermost Hugging Face model (it has ``_init_weights``) above the module at ``path``."""
    owner = None
    for p, m in part.named_modules():
        inside = p == "" or path == p or path.startswith(p + ".")
        if inside and callable(getattr(m, "_init_weights", None)) and hasattr(m, "config"):
            owner = m
    return owner


def _reinit_buffers(part: nn.Module) -> None:
    holders = _holders(part)
    for _, m in holders:
        for n, b in m._buffers.items():
            if b is not None and n in m._non_persistent_buffers_set and b.is_floating_point():
                b.fill_(float("nan"))  # the marker the check below looks for
    whole = getattr(part, "init_weights", None)
    with torch.no_grad():
        for path, m in holders:
            owner = _hf_owner(path, part)
            if owner is not None:
                owner._init_weights(m)  # type: ignore[operator]
            elif callable(whole):
                whole()  # the model's own initialiser sets every buffer; params are loaded next
                break
    _check_buffers(holders, type(part).__name__)


def _check_buffers(holders: Sequence[tuple[str, nn.Module]], model: str) -> None:
    left = [
        f"{path}.{n}" if path else n
        for path, m in holders
        for n, b in m._buffers.items()
        if b is not None and b.is_floating_point() and bool(torch.isnan(b).any())
    ]
    if left:
        raise PretrainedError(
            f"load_pretrained: {model} was on the meta device and its non-persistent buffers "
            f"{left[:5]} are in no checkpoint, and nothing recomputed them (a Hugging Face "
            "model's _init_weights or the model's init_weights()); give the model an "
            "init_weights() that sets them, or build it on a real device"
        )
