"""Checkpoints: the whole training state, sharded with ``torch.distributed.checkpoint``,
committed atomically with a verified manifest, resumed from the newest valid one on any world
size. ``Run`` owns a :class:`Checkpointer` (``run.resume``, ``run.save_checkpoint`` and the
saves every ``checkpoint.interval`` steps); ``layout`` is the pure part (naming, manifest,
validation, retention). See docs/checkpoint.md."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.checkpoint.checks import CheckpointError
    from meshrun.checkpoint.layout import CheckpointInfo, list_checkpoints, problems
    from meshrun.checkpoint.manager import Checkpointer, Stateful

__getattr__ = lazy_exports(
    globals(),
    {
        "CheckpointError": "meshrun.checkpoint.checks",
        "CheckpointInfo": "meshrun.checkpoint.layout",
        "list_checkpoints": "meshrun.checkpoint.layout",
        "problems": "meshrun.checkpoint.layout",
        "Checkpointer": "meshrun.checkpoint.manager",
        "Stateful": "meshrun.checkpoint.manager",
    },
)

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointer",
    "Stateful",
    "list_checkpoints",
    "problems",
]
