"""ZeRO-2/3 and HSDP with FSDP2 ``fully_shard``: each block first, then the root.

Stage 3 reshards parameters after the forward (all-gathered again for the backward); stage 2
keeps them unsharded from forward to backward (one all-gather per step, more memory): both
reduce-scatter gradients, so gradients and optimizer state are sharded in both. With a 2-D
``(dp_replicate, dp_shard)`` mesh FSDP2 is HSDP: sharded inside a group, replicated across.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun.parallel.meta_init import materialize_as_one_process

# FSDP (with the DTensor it imports, about a second of CPU) is imported by apply_fsdp, so a DDP
# run never imports it.
if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

# A predicate choosing the submodules that become their own FSDP unit (their own all-gather).
WrapPredicate = Callable[[str, "nn.Module | None"], bool]

BLOCK_LISTS = ("blocks", "layers", "h")  # the ModuleList names of common transformer stacks


def is_block(name: str, module: nn.Module | None = None) -> bool:
    """Default predicate: each member of a ``blocks``/``layers``/``h`` ModuleList."""
    parent, _, index = name.rpartition(".")
    return index.isdigit() and parent.rpartition(".")[2] in BLOCK_LISTS


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    zero: int,
    cpu_offload: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    wrap: WrapPredicate = is_block,
    prefetch: int = 0,
    blocks_per_unit: int = 1,
) -> FSDPModule:
    """Shard ``model`` in place: ``fully_shard`` each unit chosen by ``wrap`` (``blocks_per_unit``
    consecutive ones together), then the root."""
    if zero not in (2, 3):
        raise ValueError(f"apply_fsdp: zero = {zero}; FSDP2 runs ZeRO stages 2 and 3")
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    mp = mp_policy or MixedPrecisionPolicy()
    blocks = [m for n, m in model.named_modules() if n and wrap(n, m)]
    groups = [blocks[i : i + blocks_per_unit] for i in range(0, len(blocks), blocks_per_unit)]
    units: list[FSDPModule] = []
    for group in groups:
        # A list makes one FSDP unit of several modules: one all-gather and one reduce-scatter.
        target: nn.Module | list[nn.Module] = group[0] if len(group) == 1 else group
        fully_shard(
            target, mesh=mesh, reshard_after_forward=zero == 3, mp_policy=mp, offload_policy=offload
        )
        units.append(cast(FSDPModule, group[0]))  # the group's modules share one FSDP state
    # The root's parameters (embeddings, head) are used at both ends of the step; keeping them
    # unsharded after the forward saves one all-gather for little memory.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    assert isinstance(model, FSDPModule)
    # ...but after a forward without grad (an evaluation) no backward comes to reshard them:
    # the model would keep its unsharded Parameters registered, and an optimizer built then
    # would step tensors the next training forward no longer reads. Registered after FSDP2's
    # own post-forward hook, so it runs after it.
    model.register_forward_hook(_reshard_without_grad([*units, model]))
    if prefetch:
        apply_prefetch(units, prefetch, async_unshard=mesh.device_type == "cpu")
    return model


def _reshard_without_grad(units: list[FSDPModule]) -> Callable[..., None]:
    """A forward hook for the root: when grad is disabled, reshard every unit (the root, and
    under ZeRO-2 every block, stay unsharded after a forward that has no backward)."""

    def hook(module: nn.Module, args: object, output: object) -> None:
        if not torch.is_grad_enabled():
            for unit in units:
                unit.reshard()

    return torch.compiler.disable(hook)  # like FSDP2's own hooks: outside a compiled graph


def apply_prefetch(units: list[FSDPModule], depth: int, async_unshard: bool = False) -> None:
    """Explicit prefetch: each unit starts the all-gathers of the next ``depth`` units (in
    forward order, and in reverse order for the backward), so more communication overlaps
    compute, for ``depth`` units' worth of extra unsharded memory.

    ``async_unshard`` (CPU): without CUDA streams FSDP2 waits for every all-gather where it is
    issued, so a prefetch overlaps nothing unless it is issued with ``async_op=True``; the
    all-gather then runs on Gloo's thread while this one computes, and FSDP2 waits for it
    just before the unit's forward (``_set_unshard_async_op``, private in torch 2.13)."""
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + depth])
        earlier = units[max(0, i - depth) : i]
        unit.set_modules_to_backward_prefetch(earlier[::-1])
        if async_unshard:
            unit._set_unshard_async_op(True)


def has_meta_params(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def init_weights_of(model: nn.Module, allocated: str = "it") -> Callable[[], None]:
    """The ``init_weights()`` a meta-device model needs once ``allocated`` (what meshrun
    allocates with ``to_empty()``) exists; TypeError naming the fix if it has none."""
    init = getattr(model, "init_weights", None)
    if not callable(init):
        raise TypeError(
            f"{type(model).__name__} was built on the meta device but has no init_weights() "
            f"method: meshrun allocates {allocated} with to_empty() and must then initialise "
            "it; add init_weights() (see meshrun.demo.model.GPT) or build the model on a real "
            "device"
        )
    return init


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate a meta-device model (after its layout, only each rank's shards) and initialise
    it with its ``init_weights()`` to one process's values: the initialiser runs once on
    full-size host copies and each rank keeps its slice (parallel/meta_init.py)."""
    materialize_as_one_process(model, init_weights_of(model), [model], device)
