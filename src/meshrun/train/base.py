"""The fields every part of :class:`meshrun.Run` reads: ``Run.__init__`` (train/run.py) sets
them; the method groups (train/model.py, train/data.py, train/stepping.py, train/evaluate.py) only declare
what they read, so each group is a small module and ``Run`` stays one object."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from meshrun.checkpoint import Checkpointer
from meshrun.config import Config
from meshrun.monitor import MetricsLogger
from meshrun.runtime.cluster import ClusterEnv
from meshrun.runtime.mesh import ParallelDims
from meshrun.runtime.state import TrainState
from meshrun.train.loop import StepLoop


class RunFields:
    """Declarations only (no methods): what ``Run.__init__`` builds, typed for the mixins."""

    config: Config
    cluster: ClusterEnv
    rank: int
    world_size: int
    local_rank: int
    dims: ParallelDims
    device: torch.device
    backend: str
    mesh: DeviceMesh | None
    dp_size: int
    dp_rank: int
    accum: int
    is_main: bool
    run_dir: Path
    log: logging.Logger
    metrics: MetricsLogger
    state: TrainState
    loop: StepLoop
    checkpointer: Checkpointer
