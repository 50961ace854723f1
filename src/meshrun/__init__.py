"""meshrun: take a PyTorch training script from one GPU to many GPU servers.

import meshrun

@meshrun.main
def main():
    run = meshrun.init()                      # config: file, MESHRUN_CONFIG, --section.key=value
    model = run.parallelize(build_model())    # layout from [parallel]; a real torch module
    opt = torch.optim.AdamW(model.parameters(), lr=run.scaled_lr())
    loader = run.dataloader(dataset)          # resumable, world-size-independent order
    for batch in run.steps(loader):           # accumulation, timing, metrics, progress
        run.backward(compute_loss(model, batch))
        run.optimizer_step(opt)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports
from meshrun._version import __version__
from meshrun.config import Config, ConfigError, load_config

# The rest loads on first use (PEP 562): the command line and the pure layers (config, plan)
# then start in a fraction of a second instead of paying for torch.distributed's imports.
_LAZY = {
    "ResumableSampler": "meshrun.data",
    "build_dataloader": "meshrun.data",
    "main": "meshrun.train.entry",
    "ParallelDims": "meshrun.runtime.mesh",
    "Run": "meshrun.train.run",
    "init": "meshrun.train.run",
    "lr_factor": "meshrun.runtime.schedule",
    "scale_lr": "meshrun.runtime.schedule",
}

if TYPE_CHECKING:
    from meshrun.data import ResumableSampler, build_dataloader
    from meshrun.runtime.mesh import ParallelDims
    from meshrun.runtime.schedule import lr_factor, scale_lr
    from meshrun.train.entry import main
    from meshrun.train.run import Run, init


__getattr__ = lazy_exports(globals(), _LAZY)

__all__ = [
    "Config",
    "ConfigError",
    "ParallelDims",
    "ResumableSampler",
    "Run",
    "__version__",
    "build_dataloader",
    "init",
    "load_config",
    "lr_factor",
    "main",
    "scale_lr",
]
