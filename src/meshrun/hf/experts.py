"""Expert tensors in a pretrained load: an expert-parallel rank's share of each MoE layer, and
Hugging Face's per-expert files read into a model's fused expert tensors.

- Under ``parallel.ep`` each rank holds ``E / ep`` experts of every MoE layer
  (parallel/ep.py): a fused tensor ``[E/ep, ...]`` under the model's name (this rank's experts
  ``first .. first + E/ep`` on the expert dim), or ``E/ep`` experts of a ``ModuleList`` under
  local indices. :func:`global_view` gives them the names and shapes one process has, with the
  offset of this rank's experts, so a rank reads only its experts' rows (``get_slice``) or
  keys. The other experts' names and shapes are checked too (every rank takes the same
  decision: one rank refusing alone would leave the others waiting in their next collective),
  never read.
- transformers 5 builds its MoE layers with fused expert tensors (``experts.gate_up_proj``
  ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``) while ``save_pretrained`` writes, and
  the hub holds, one tensor per expert (``experts.<e>.gate_proj.weight``, ...), converted by the
  model's own conversion mapping (``transformers.conversion_mapping``). A fused model tensor the
  files lack is read from those per-expert tensors (:func:`per_expert_sources`) when the mapping
  says how in the two ways read here: stacked on the expert dim (``MergeModulelist(dim=0)``),
  then, for several source patterns, concatenated on dim 1 (``Concatenate(dim=1)``). Any other
  conversion (renamed module paths such as Mixtral's ``block_sparse_moe``, transposes,
  interleaves, quantized experts) is not: its names then stay missing and the load is refused
  before anything is read, naming them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from meshrun.hf.names import PretrainedError
from meshrun.hf.reading import Region, TensorInfo, copy_region

__all__ = ["ExpertShare", "ExpertView", "Merged", "global_view", "per_expert_sources"]

_PLAIN = re.compile(r"^\^?\.?[\w.]*\*[\w.]*$")  # a source pattern with one '*', nothing else


@dataclass(frozen=True)
class ExpertShare:
    """One expert container as this rank holds it under ``parallel.ep``."""

    prefix: str  # the container's FQN, cleaned of wrapper components
    num_experts: int  # E
    first: int  # the global index of this rank's first expert
    count: int  # E / ep
    dim: int  # the expert dim of its fused tensors
    lists: tuple[str, ...] = ()  # its ModuleLists of experts (local indices)


@dataclass
class ExpertView:
    """The model's tensors under the names one process has."""

    tensors: dict[str, Tensor]  # name -> this rank's tensor (the ones it fills)
    shapes: dict[str, tuple[int, ...]]  # every rank's names with their whole shapes (the check)
    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)  # fused: (dim, first)


def global_view(tensors: dict[str, Tensor], shares: Sequence[ExpertShare]) -> ExpertView:
    """``tensors`` (cleaned names) as one process names and shapes them (module docstring)."""
    view = ExpertView({}, {})
    for name, t in tensors.items():
        share = next((s for s in shares if name.startswith(s.prefix + ".")), None)
        shape = tuple(t.shape)
        if share is None:
            view.tensors[name], view.shapes[name] = t, shape
            continue
        head, _, tail = name[len(share.prefix) + 1 :].partition(".")
        if head in share.lists:
            i, _, rest = tail.partition(".")
            view.tensors[f"{share.prefix}.{head}.{share.first + int(i)}.{rest}"] = t
            for e in range(share.num_experts):
                view.shapes[f"{share.prefix}.{head}.{e}.{rest}"] = shape
        elif not tail and t.dim() > share.dim and t.shape[share.dim] == share.count:
            whole = list(shape)
            whole[share.dim] = share.num_experts
            view.tensors[name], view.shapes[name] = t, tuple(whole)
            view.offsets[name] = (share.dim, share.first)
        else:  # apply_ep refuses containers with other parameters: not reached
            view.tensors[name], view.shapes[name] = t, shape
    return view


def shifted(region: Region | None, local: Tensor, offset: tuple[int, int] | None) -> Region | None:
    """The region of the whole tensor a rank holds, with its experts' offset on their dim."""
    if offset is None:
        return region
    dim, first = offset
    box = list(region or tuple(slice(0, n) for n in local.shape))
    box[dim] = slice(box[dim].start + first, box[dim].stop + first)
    return tuple(box)


@dataclass(frozen=True)
class Merged:
    """A fused ``[E, ...]`` model tensor held in the files as per-expert tensors: each expert's
    part names (``{}``: the expert index), concatenated on dim 1 of the fused tensor."""

    parts: tuple[str, ...]

    def names(self, expert: int) -> list[str]:
        return [p.format(expert) for p in self.parts]


def _converters(parts: Sequence[nn.Module]) -> list[tuple[list[str], str]]:
    """``(source patterns, target)`` of the models' stack(-and-concatenate) expert converters."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:  # transformers absent or another version: nothing to convert
        return []
    out = []
    for part in parts:
        if not isinstance(part, PreTrainedModel):
            continue
        for c in get_model_conversion_mapping(part):
            ops = getattr(c, "operations", [])
            kinds = [(type(o), getattr(o, "dim", None)) for o in ops]
            stack = kinds[:1] == [(MergeModulelist, 0)]
            concat = kinds[1:] == ([(Concatenate, 1)] if len(c.source_patterns) > 1 else [])
            plain = all(_PLAIN.match(p) for p in c.source_patterns)
            if isinstance(c, WeightConverter) and stack and concat and plain:
                target = c.target_patterns[0].lstrip("^").lstrip(".")
                out += [([p.lstrip("^").lstrip(".") for p in c.source_patterns], target)]
    return out


def per_expert_sources(
    parts: Sequence[nn.Module],
    wanted: dict[str, tuple[int, ...]],
    index: dict[str, TensorInfo],
) -> dict[str, Merged]:
    """For each fused model tensor in ``wanted`` (name -> whole shape ``[E, ...]``) that the
    files lack: its per-expert tensors, when the model's conversion mapping names them and the
    files hold them for every expert."""
    found: dict[str, Merged] = {}
    recipes = _converters(parts) if wanted else []
    for name, shape in wanted.items():
        for sources, target in recipes:
            if not (name == target or name.endswith("." + target)):
                continue
            base = name[: len(name) - len(target)]
            merged = Merged(tuple(base + s.replace("*", "{}") for s in sources))
            if all(n in index for e in range(shape[0]) for n in merged.names(e)):
                found[name] = merged
                break
    return found


def merged_info(merged: Merged, index: dict[str, TensorInfo], experts: int) -> TensorInfo:
    """The fused tensor the per-expert tensors make: ``[E, sum of the parts' dim 0, ...]``."""
    first = [index[n] for n in merged.names(0)]
    rows = sum(i.shape[0] for i in first) if len(first) > 1 else None
    rest = first[0].shape[1:] if rows is not None else first[0].shape
    shape = (experts, rows, *rest) if rows is not None else (experts, *rest)
    return TensorInfo(first[0].file, shape, first[0].dtype)


def read_merged(
    merged: Merged,
    index: dict[str, TensorInfo],
    region: Region | None,
    local: Tensor,
) -> int:
    """Fill ``local`` (the experts ``region`` covers on dim 0, whole on the other dims) from
    those experts' own tensors only; the bytes read."""
    lo = region[0].start if region else 0
    if region and any(
        (s.start, s.stop) != (0, n) for s, n in zip(region[1:], local.shape[1:], strict=True)
    ):
        raise PretrainedError(
            f"{merged.parts[0]}: a model tensor split inside each expert (a tensor-parallel "
            "expert) cannot be read from per-expert tensors; split experts over parallel.ep, "
            "or save the model with save_pretrained(..., save_original_format=False)"
        )
    read = 0
    with torch.no_grad():
        for k in range(local.shape[0]):
            names = merged.names(lo + k)
            row = 0
            for n in names:
                info = index[n]
                into = local[k] if len(names) == 1 else local[k].narrow(0, row, info.shape[0])
                read += copy_region(info, n, None, into)
                row += info.shape[0]
    return read
