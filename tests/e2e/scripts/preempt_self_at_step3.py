"""A meshrun script with no run.resume and (by the test's flags) no checkpoint.interval: rank 0
sends itself SIGUSR1 after step 3, as SLURM's --signal=USR1@S would. The preemption save must
still happen: step 4's boundary writes a checkpoint and every rank exits 0."""

import os
import signal

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
        if run.optimizer_step(opt) and run.step == 3 and run.rank == 0:
            os.kill(os.getpid(), signal.SIGUSR1)


if __name__ == "__main__":
    main()
