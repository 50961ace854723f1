"""What the user's training loop touches: :func:`meshrun.init` starts a run (the start-up
order reads top to bottom in ``run.py`` and ``train/startup.py``), :class:`Run` is its handle (model
and layout, data and LR, the step and its checkpoints, evaluation), ``train/loop.py`` is the step
loop underneath, ``train/entry.py`` is ``@meshrun.main``."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.train.entry import main
    from meshrun.train.run import Run, init

__getattr__ = lazy_exports(
    globals(),
    {"Run": "meshrun.train.run", "init": "meshrun.train.run", "main": "meshrun.train.entry"},
)

__all__ = ["Run", "init", "main"]
