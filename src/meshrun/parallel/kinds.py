"""``isinstance`` checks for DTensor, FSDP2 modules and ZeRO-1 optimizers that import none of them
(pipelines: ``parallel/pp/kind.py``).

``torch.distributed.tensor`` and ``torch.distributed.fsdp`` cost about a second of CPU to import;
a plain DDP run never needs them, nor meshrun's pipeline modules (``parallel/pp*.py``). Before a
module is imported none of its classes can have an instance, so an absent module answers
``False`` without importing it."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    """``isinstance(t, DTensor)``, without importing ``torch.distributed.tensor``."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def is_fsdp_module(m: object) -> TypeGuard[FSDPModule]:
    """``isinstance(m, FSDPModule)`` (``fully_shard``), without importing FSDP."""
    mod = sys.modules.get("torch.distributed.fsdp")
    return mod is not None and isinstance(m, mod.FSDPModule)


def is_zero_redundancy(optimizer: object) -> TypeGuard[ZeroRedundancyOptimizer]:
    """``isinstance(optimizer, ZeroRedundancyOptimizer)`` (ZeRO-1), without importing
    ``torch.distributed.optim`` (about 0.3 s of CPU)."""
    mod = sys.modules.get("torch.distributed.optim")
    return mod is not None and isinstance(optimizer, mod.ZeroRedundancyOptimizer)
