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

from meshrun.config import Config, ConfigError, load_config
from meshrun.data import ResumableSampler, build_dataloader
from meshrun.entry import main
from meshrun.mesh import ParallelDims
from meshrun.runtime import Run, init
from meshrun.schedule import lr_factor, scale_lr

__version__ = "0.1.0"

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
