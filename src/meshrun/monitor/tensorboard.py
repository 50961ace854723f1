"""The optional TensorBoard sink: the numbers of each written ``metrics.jsonl`` step line as
scalars under ``RUN_DIR/tensorboard`` (``metrics.tensorboard = true``; main rank only, so
exactly one writer). Needs the ``tensorboard`` package (``pip install 'meshrun[tensorboard]'``);
asking for the sink without it is an error that says so, never a silent no-op.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["TENSORBOARD_DIR", "TensorBoardSink", "check_tensorboard"]

TENSORBOARD_DIR = "tensorboard"
_SKIP = frozenset({"step", "time"})  # the x axis and the wall clock are not curves


def check_tensorboard() -> None:
    """Raise a clear error when the sink is asked for but cannot work."""
    try:
        import tensorboard  # noqa: F401  # torch's SummaryWriter needs it
    except ImportError:
        raise RuntimeError(
            "metrics.tensorboard = true needs the tensorboard package: "
            "pip install 'meshrun[tensorboard]' (or tensorboard), or set "
            "--metrics.tensorboard=false"
        ) from None


class TensorBoardSink:
    """One ``SummaryWriter``; ``add`` writes every finite number of a step line."""

    def __init__(self, run_dir: Path) -> None:
        check_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.path = run_dir / TENSORBOARD_DIR
        self._writer: Any = SummaryWriter(log_dir=str(self.path))

    def add(self, step: int, row: Mapping[str, Any]) -> None:
        for key, value in row.items():
            if key in _SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self._writer.add_scalar(f"train/{key}", value, global_step=step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
