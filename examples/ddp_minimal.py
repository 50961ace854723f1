"""The smallest correct multi-node DDP script with meshrun: your model, your data, your loop.

meshrun launch --nproc-per-node 2 examples/ddp_minimal.py --optim.steps=50
# on N nodes, the same command with --nnodes N and a rendezvous endpoint, or under srun
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import meshrun


@meshrun.main  # traceback to the launcher, clean teardown and exit
def main() -> None:
    run = meshrun.init()  # config: meshrun launch's file, then --section.key=value
    x = torch.randn(4096, 32, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x @ torch.randn(32, 1, generator=torch.Generator().manual_seed(1)))
    model = run.parallelize(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=run.scaled_lr(1e-2))
    run.lr_scheduler(opt)  # warmup + decay from [optim]
    for inputs, targets in run.steps(run.dataloader(data)):  # each rank: its share of a batch
        loss = nn.functional.mse_loss(model(inputs), targets)
        run.backward(loss)  # / accumulation; all-reduce only on the last micro-step
        run.optimizer_step(opt)  # steps on accumulation boundaries, logs metrics


if __name__ == "__main__":
    main()
