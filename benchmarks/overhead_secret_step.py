"""The script of ``overhead_secret.py``: ``meshrun.init()``, one training step, and rank 0
writes the wall-clock time of the end of that step to the file ``FIRST_STEP`` names."""

import os
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import meshrun


@meshrun.main
def main() -> None:
    run = meshrun.init()
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = run.parallelize(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for inputs, targets in run.steps(run.dataloader(data)):
        run.backward(nn.functional.mse_loss(model(inputs), targets))
        if run.optimizer_step(opt) and run.rank == 0:
            Path(os.environ["FIRST_STEP"]).write_text(repr(time.time()))


if __name__ == "__main__":
    main()
