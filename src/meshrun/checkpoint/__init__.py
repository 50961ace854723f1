"""Checkpoints: the whole training state, sharded with ``torch.distributed.checkpoint``,
committed atomically with a verified manifest, resumed from the newest valid one on any world
size. ``Run`` owns a :class:`Checkpointer` (``run.resume``, ``run.save_checkpoint`` and the
saves every ``checkpoint.interval`` steps), which reads and writes the run's ``TrainState``
(meshrun/runtime/state.py) and takes ``[checkpoint]`` and a :class:`RunFacts` record, not the whole
config. One module per concern: ``targets`` (what is saved), ``commit`` (protocol, manifest,
retention), ``async_save`` (staging), ``preemption`` (signals), ``resume`` (load, re-shard);
``on_disk`` is the pure part (naming, manifest, validation, retention). See
docs/checkpoint.md."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.checkpoint.checkpointer import Checkpointer
    from meshrun.checkpoint.checks import CheckpointError
    from meshrun.checkpoint.facts import RunFacts
    from meshrun.checkpoint.on_disk import CheckpointInfo, list_checkpoints, problems
    from meshrun.checkpoint.targets import Stateful

__getattr__ = lazy_exports(
    globals(),
    {
        "CheckpointError": "meshrun.checkpoint.checks",
        "CheckpointInfo": "meshrun.checkpoint.on_disk",
        "list_checkpoints": "meshrun.checkpoint.on_disk",
        "problems": "meshrun.checkpoint.on_disk",
        "Checkpointer": "meshrun.checkpoint.checkpointer",
        "RunFacts": "meshrun.checkpoint.facts",
        "Stateful": "meshrun.checkpoint.targets",
    },
)

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointer",
    "RunFacts",
    "Stateful",
    "list_checkpoints",
    "problems",
]
