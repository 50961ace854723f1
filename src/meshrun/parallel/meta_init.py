"""A model built on the meta device gets one process's values under every layout.

A layout (FSDP2's ZeRO-2/3 and HSDP, tensor parallel, both, a pipeline stage) leaves each rank
holding only its shards. Running the user's ``init_weights()`` on those shards initialises
each shard as if it were a whole tensor: every rank draws its shard from the same RNG state
(on CPU nothing else advances it; torch's DTensor RNG tracker covers CUDA only), so a weight
is one shard repeated, and ``reset_parameters()`` takes its fan-in from the shard's shape.
The model then trains from another model than one process's, without a word.

:func:`materialize_as_one_process` allocates the rank's part with ``to_empty`` (the places
that shared one Parameter share one again), then runs the initialiser once on full tensors,
exactly as one process runs it:

1. every parameter and buffer of the model (a DTensor's global shape) is swapped for a
   full-size plain tensor on the host (a plain CPU tensor already is one: it is used as it
   is), tied ones (one Parameter in two places when the model was built) for one tensor;
   those of other pipeline stages (still on meta here) for views of one scratch buffer, so
   the draws for them advance the RNG as on one process;
2. ``init_weights()`` runs once on them under ``no_grad``, from the CPU RNG state rank 0
   holds (every rank the same stream: one process's);
3. each rank keeps its slice: DTensor's own ``distribute_tensor`` cuts it (with no
   communication: every rank holds the same full tensor), copied into the rank's local
   shard; a plain tensor is copied whole; a tensor still on meta (another stage's) is left;
4. the layout's own tensors go back in their places and the full copies are freed.

A one-process run of a meta-built model takes the same route, so its values equal every
layout's by construction, on CPU and on CUDA (the initialiser always runs on the host).

What the initialiser may assume: it sees the whole model as one process builds it (full
shapes, plain tensors on the CPU, ties intact); it may call ``reset_parameters()``, the
``nn.init`` functions, in-place ops, and assign new tensors to parameters or buffers (a new
Parameter's values are copied into the layout's). It must set every floating-point
parameter and buffer: the full copies start as NaN, and one still NaN afterwards is refused
naming it (a forgotten layer would otherwise train from garbage).

Cost: a full-size host copy of each sharded or non-CPU tensor the rank holds (under ZeRO-3 or
TP the whole model's size; nothing for plain CPU tensors: one process's, a pipeline stage's)
while the initialiser runs (freed afterwards), plus the largest tensor of the other stages;
and the initialiser's time on the host's cores at full size, the whole model on every rank
(docs/parallel.md gives measured figures). A value an initialiser computes from
another stage's tensor (a copy across stages) is not one process's: a tie across stages is made
equal afterwards by parallel/pp/tied.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["materialize_as_one_process"]


@dataclass
class _Slot:
    """One place a tensor is held: ``module._parameters[name]`` or ``module._buffers[name]``."""

    path: str
    module: nn.Module
    table: str  # "_parameters" or "_buffers"
    name: str
    held: Tensor  # the layout's tensor (a DTensor, a plain tensor, or meta for other stages)

    def get(self) -> Tensor | None:
        return getattr(self.module, self.table)[self.name]

    def put(self, t: Tensor) -> None:
        getattr(self.module, self.table)[self.name] = t

    @property
    def fqn(self) -> str:
        return f"{self.path}.{self.name}" if self.path else self.name


def materialize_as_one_process(
    model: nn.Module, init: Callable[[], None], parts: Sequence[nn.Module], device: torch.device
) -> None:
    """Allocate ``parts`` of the meta-built ``model`` (the model itself, or this rank's pipeline
    stages) on ``device`` with ``to_empty``, then run ``init`` (the model's ``init_weights``)
    once on full-size host copies of all of ``model``'s parameters and buffers and copy each
    rank's slice into its own tensors; see the module docstring."""
    ties = [id(s.held) for s in _slots(model)]  # to_empty gives each place a tensor of its own
    for part in parts:
        _allocate(part, device)
    slots = _slots(model)
    full = _full_copies(ties, slots)
    _same_rng_as_rank0()
    try:
        for tie, s in zip(ties, slots, strict=True):
            s.put(full[tie])
        with torch.no_grad():
            init()
        after = [(s, s.get()) for s in slots]
    finally:
        for s in slots:
            s.put(s.held)
    del full
    _refuse_unset(after)
    with torch.no_grad():
        for s, value in after:
            _keep_slice(s, value)


def _allocate(part: nn.Module, device: torch.device) -> None:
    """``to_empty``, then one tensor again in each set of places that shared one before."""
    shared: dict[int, list[_Slot]] = {}
    for s in _slots(part, "_parameters"):
        shared.setdefault(id(s.held), []).append(s)
    part.to_empty(device=device)
    for group in shared.values():
        first = group[0].get()
        assert first is not None
        for s in group[1:]:
            s.put(first)


def _slots(model: nn.Module, *tables: str) -> list[_Slot]:
    """Every place ``model`` holds a parameter or buffer, in a fixed order."""
    return [
        _Slot(path, m, table, name, t)
        for path, m in model.named_modules(remove_duplicate=False)
        for table in tables or ("_parameters", "_buffers")
        for name, t in getattr(m, table).items()
        if t is not None
    ]


def _full_copies(ties: list[int], slots: list[_Slot]) -> dict[int, Tensor]:
    """A full host copy per tied group this rank keeps something of; a group held by no slot
    here (another pipeline stage's, still on meta) gets a view of one scratch buffer per dtype
    instead: the initialiser's draws on it advance the RNG exactly as on its own tensor (they
    depend on the shape, not the values), and the values are never kept, so the rank's memory
    is its own tensors' full size plus the largest other tensor, not the whole model's."""
    groups: dict[int, list[Tensor]] = {}
    for tie, s in zip(ties, slots, strict=True):
        groups.setdefault(tie, []).append(s.held)
    full: dict[int, Tensor] = {}
    for tie, held in groups.items():
        mine = [x for x in held if not x.is_meta]
        if mine:
            full[tie] = _full_copy(mine[0])
    elsewhere = {t: h[0] for t, h in groups.items() if t not in full}
    scratch: dict[torch.dtype, Tensor] = {}
    for t in elsewhere.values():
        have = scratch.get(t.dtype)
        if have is None or have.numel() < t.numel():
            scratch[t.dtype] = torch.empty(t.numel(), dtype=t.dtype)
    for tie, t in elsewhere.items():
        view = scratch[t.dtype][: t.numel()].view(t.shape)
        full[tie] = nn.Parameter(view, t.requires_grad) if isinstance(t, nn.Parameter) else view
    return full


def _full_copy(t: Tensor) -> Tensor:
    """A plain host tensor of ``t``'s global shape and dtype, NaN where that can be marked:
    ``t`` itself when it is one already (no copy: one process's own tensor on the CPU, a
    pipeline stage's without a sharded layout), else a new one."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) or t.device.type != "cpu":
        full = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        if isinstance(t, nn.Parameter):
            full = nn.Parameter(full, requires_grad=t.requires_grad)
    else:
        full = t
    if full.is_floating_point() or full.is_complex():
        with torch.no_grad():
            full.fill_(float("nan"))  # the marker _refuse_unset looks for
    return full


def _same_rng_as_rank0() -> None:
    """Every rank draws the full tensors from rank 0's CPU RNG state: the same values on each
    rank (each keeps its own slice) whatever a script did with the RNG on one rank alone."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    state = [torch.get_rng_state()]
    dist.broadcast_object_list(state, src=0)
    torch.set_rng_state(state[0])


def _refuse_unset(after: list[tuple[_Slot, Tensor | None]]) -> None:
    unset = sorted(
        {
            s.fqn
            for s, v in after
            if v is not None
            and not s.held.is_meta  # another stage's: a scratch view, never kept
            and (v.is_floating_point() or v.is_complex())
            and _has_nan(v)
        }
    )
    if unset:
        raise TypeError(
            f"the model was built on the meta device and its init_weights() left {unset[:5]}"
            f"{' and more' if len(unset) > 5 else ''} unset (still NaN); make init_weights() set "
            "every parameter and floating-point buffer (e.g. call each layer's "
            "reset_parameters()), or build the model on a real device"
        )


def _has_nan(t: Tensor) -> bool:
    # Meta and fake tensors (the planner's trace) hold no values to look at.
    if t.is_meta or isinstance(t, FakeTensor):
        return False
    return bool(torch.isnan(t.detach()).any())


def _keep_slice(s: _Slot, value: Tensor | None) -> None:
    """Copy this rank's part of the full ``value`` into the slot's own tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    held = s.held
    if value is None or held.is_meta:  # removed by the initialiser, or another stage's tensor
        return
    value = value.detach()
    if value.data_ptr() == held.data_ptr():  # initialised in place (_full_copy)
        return
    if isinstance(held, DTensor):
        _check_shape(s, value, tuple(held.shape))
        # src_data_rank=None: each rank cuts its own shard from its (identical) full tensor
        mine = distribute_tensor(value, held.device_mesh, held.placements, src_data_rank=None)
        held.to_local().copy_(mine.to_local())
    elif value.shape == held.shape:
        held.copy_(value)
    elif isinstance(held, nn.Parameter):
        _check_shape(s, value, tuple(held.shape))
    else:  # a buffer the initialiser recomputed with another shape: one process's
        s.put(value.to(held.device))


def _check_shape(s: _Slot, value: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(value.shape) != shape:
        raise TypeError(
            f"init_weights() gave {s.fqn} the shape {tuple(value.shape)}, but the model was "
            f"built with {shape}; initialise parameters in place (nn.init, reset_parameters())"
        )
