"""Sharded loading of a Hugging Face directory into an already parallelized model (docs/hf.md).

``load_pretrained(model, directory, device=...)``, called on every rank after
``run.parallelize`` (or ``run.pipeline``):

1. the checkpoint's names, shapes and files come from the safetensors headers (reading.py);
2. the model's names (wrappers' components cleaned off), ties and global shapes are matched
   with them (names.py); under pipeline parallelism every rank holds only its stages, so the
   names and shapes of all ranks are gathered first (one ``all_gather_object``) and every rank
   takes the same decision. Missing or unexpected names and other shapes are one error,
   raised on every rank before any weight is read;
3. parameters still on the meta device are allocated (placing.py);
4. each rank reads, tensor by tensor, only the region of the whole tensor it holds
   (``get_slice``), straight into its local tensor. Nothing else is exchanged: no broadcast,
   no rank holding the whole model. Peak host memory per rank: its shards plus one region
   (at most the largest tensor) of mapped file pages. Under expert parallel a rank reads its
   own experts only, and a fused expert tensor the files hold per expert is read from its
   experts' tensors (experts.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from meshrun.hf.experts import (
    ExpertShare,
    ExpertView,
    Merged,
    global_view,
    merged_info,
    per_expert_sources,
    read_merged,
    shifted,
)
from meshrun.hf.names import NameMap, PretrainedError, match_names, mismatch_text
from meshrun.hf.placing import (
    alias_map,
    declared_ties,
    identity_ties,
    ignored_unexpected,
    local_region,
    materialize_parts,
    model_parts,
    named_tensors,
)
from meshrun.hf.reading import TensorInfo, copy_region, read_index

__all__ = ["LoadReport", "load_pretrained"]

log = logging.getLogger("meshrun")

# What one rank tells the others under pipeline parallelism: its names with global shapes,
# and the tied pairs it knows of.
Facts = tuple[dict[str, tuple[int, ...]], list[tuple[str, str]]]


@dataclass(frozen=True)
class LoadReport:
    """What one rank loaded: tensors written, bytes read from the files, how names matched."""

    tensors: int
    bytes_read: int
    checkpoint_bytes: int  # the whole checkpoint's tensors
    rule: str
    seconds: float
    allocated: bool  # this rank allocated parameters that were on the meta device


def load_pretrained(
    model: Any,
    directory: str | Path,
    *,
    device: torch.device | str | None = None,
    strict: bool = True,
    partial: bool | None = None,
    experts: Sequence[ExpertShare] = (),
) -> LoadReport:
    """Fill ``model`` (parallelized, or the ``Pipeline`` of ``run.pipeline``; on the meta
    device or allocated) with the weights of the Hugging Face ``directory``
    (``model.safetensors``, or ``model.safetensors.index.json`` and its shards). Call it on
    every rank. ``device``: where parameters still on the meta device are allocated (default:
    the device of the model's allocated tensors, else CPU). ``strict=False`` logs unexpected
    checkpoint tensors instead of refusing them; missing ones are always an error (they would
    keep random values). ``partial``: this rank holds only part of the model (a pipeline's
    stages): the names of all ranks are gathered (collective); default: a ``Pipeline`` or a
    stage module is partial. ``experts``: this rank's share of each expert-parallel MoE layer
    (``run.load_pretrained`` passes it): only those experts are read."""
    t0 = time.perf_counter()
    where = str(directory)
    parts, is_part, tied = model_parts(model)
    partial = is_part if partial is None else partial
    view = global_view(named_tensors(parts), experts)
    files = read_index(Path(directory))
    pairs = [*tied, *declared_ties(parts), *identity_ties(view.tensors)]
    shapes, pairs = _gather((view.shapes, pairs), partial)
    index, merged = _with_merged(parts, shapes, files)
    names = match_names(list(shapes), index, alias_map(pairs), ignored_unexpected(parts))
    _check(where, names, shapes, index, strict)
    _check_dtypes(where, view.tensors, names, index)
    target = torch.device(device) if device is not None else _device_of(view.tensors)
    allocated = materialize_parts(parts, target) > 0
    if allocated:  # to_empty may replace the tensor objects
        view = global_view(named_tensors(parts), experts)
    count, read = _fill(view, names, files, merged)
    report = LoadReport(
        count,
        read,
        sum(i.nbytes for i in files.values()),
        names.rule,
        time.perf_counter() - t0,
        allocated,
    )
    log.info(
        "load_pretrained: %d tensors from %s (names: %s), %.1f MB read by this rank of %.1f MB, "
        "%.2f s",
        *(report.tensors, where, report.rule, read / 1e6, report.checkpoint_bytes / 1e6),
        report.seconds,
    )
    return report


def _with_merged(
    parts: list[Any], shapes: dict[str, tuple[int, ...]], files: dict[str, TensorInfo]
) -> tuple[dict[str, TensorInfo], dict[str, Merged]]:
    """The files' tensors, with each fused expert tensor they hold per expert as one entry (its
    per-expert tensors then count as read by it: none is reported unexpected)."""
    wanted = {k: s for k, s in shapes.items() if k not in files and len(s) > 1}
    merged = per_expert_sources(parts, wanted, files)
    if not merged:
        return files, {}
    used = {n for k, m in merged.items() for e in range(shapes[k][0]) for n in m.names(e)}
    index = {k: v for k, v in files.items() if k not in used}
    index.update({k: merged_info(m, files, shapes[k][0]) for k, m in merged.items()})
    return index, merged


def _fill(
    view: ExpertView, names: NameMap, files: dict[str, TensorInfo], merged: dict[str, Merged]
) -> tuple[int, int]:
    """Read each tensor's local region from its checkpoint name; ``(tensors, bytes read)``."""
    done: set[int] = set()
    read = 0
    for key, t in view.tensors.items():
        if id(t) in done:  # one tensor under two names: loaded once
            continue
        done.add(id(t))
        source = names.sources[key]
        local, region = local_region(t)
        region = shifted(region, local, view.offsets.get(key))
        if not local.numel():
            continue
        if source in merged:
            read += read_merged(merged[source], files, region, local)
        else:
            read += copy_region(files[source], source, region, local)
    return len(done), read


def _gather(mine: Facts, partial: bool) -> Facts:
    """Under pipeline parallelism: every rank's names, shapes and ties (the same on all)."""
    if not partial or not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    shapes: dict[str, tuple[int, ...]] = {}
    pairs: list[tuple[str, str]] = []
    for s, p in every:
        shapes.update(s)
        pairs += [tuple(x) for x in p]
    return shapes, pairs


def _check(
    where: str,
    names: NameMap,
    shapes: dict[str, tuple[int, ...]],
    index: dict[str, TensorInfo],
    strict: bool,
) -> None:
    """Refuse what does not fit, before anything is read or allocated."""
    other = [
        (k, shapes[k], index[c].shape)
        for k, c in names.sources.items()
        if tuple(index[c].shape) != tuple(shapes[k])
    ]
    text = mismatch_text(where, names, other, strict)
    if text:
        raise PretrainedError(text)
    if names.unexpected:
        log.warning(
            "load_pretrained(%s): %d checkpoint tensor(s) the model lacks are not loaded "
            "(strict=False), e.g. %s",
            *(where, len(names.unexpected), names.unexpected[:5]),
        )


# safetensors' dtype names of torch's dtypes (the header names a file's dtype this way)
_SAFETENSORS_DTYPE = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _check_dtypes(
    where: str, tensors: dict[str, Tensor], names: NameMap, index: dict[str, TensorInfo]
) -> None:
    """The same dtype loads; one floating-point dtype into another is a cast, printed (a bf16
    checkpoint into an fp32 model is common, and exact); anything else (an integer or bool
    tensor on either side) is an error naming the tensor and both dtypes: ``copy_`` would
    convert it silently (an int64 tensor into a float parameter: the layer loads garbage)."""
    errors: list[str] = []
    casts: dict[tuple[str, str], list[str]] = {}
    for key, t in tensors.items():
        saved = index[names.sources[key]].dtype
        mine = _SAFETENSORS_DTYPE.get(t.dtype, str(t.dtype))
        if saved == mine:
            continue
        if saved.startswith(("F", "BF")) and t.dtype.is_floating_point:
            casts.setdefault((saved, mine), []).append(key)
        else:
            errors.append(f"{key}: {saved} in the checkpoint, {mine} in the model")
    if errors:
        raise PretrainedError(
            f"load_pretrained({where}): {len(errors)} tensor(s) of another kind than the "
            f"model's: {'; '.join(errors[:5])}. Nothing was read: build the model with the "
            "checkpoint's dtypes (an integer tensor never loads into a float parameter)"
        )
    for (saved, mine), keys in sorted(casts.items()):
        log.info(
            "load_pretrained(%s): %d tensor(s) cast %s -> %s while loading, e.g. %s",
            *(where, len(keys), saved, mine, keys[0]),
        )


def _device_of(tensors: dict[str, Tensor]) -> torch.device:
    for t in tensors.values():
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")
