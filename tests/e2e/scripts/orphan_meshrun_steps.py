"""A meshrun script for the killed-launcher test: slow steps (0.2 s), each rank says it is
ready after step 2, with its PID; it stops only on a signal (preemption: save, exit 0)."""

import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import meshrun


@meshrun.main
def main() -> None:
    run = meshrun.init()
    data = TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
    model = run.parallelize(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in run.steps(run.dataloader(data)):
        run.backward(nn.functional.mse_loss(model(x), y))
        if run.optimizer_step(opt):
            if run.step == 2:
                sys.stdout.write(f"ready pid={os.getpid()}\n")
                sys.stdout.flush()
            time.sleep(0.2)


if __name__ == "__main__":
    main()
