"""A small DDP job that trains ``optim.steps`` steps and, after step ``PAUSE_AT``, waits (120 s
at most) until the file ``GO`` exists; rank 0 writes ``PAUSED`` first. The tests of a job that
trusts no one (tests/e2e/test_trust_rendezvous.py) attack it while it is paused, so no attack
depends on how fast the job runs; the pause changes no number."""

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
    pause_at, paused, go = (
        int(os.environ["PAUSE_AT"]),
        Path(os.environ["PAUSED"]),
        Path(os.environ["GO"]),
    )
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x @ torch.randn(8, 1, generator=torch.Generator().manual_seed(1)))
    model = run.parallelize(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=run.scaled_lr(1e-2))
    loader = run.dataloader(data)
    run.resume(model, opt, loader)
    for inputs, targets in run.steps(loader):
        run.backward(nn.functional.mse_loss(model(inputs), targets))
        if run.optimizer_step(opt) and run.step == pause_at:
            if run.rank == 0:
                paused.write_text(f"paused after step {run.step}\n")
            deadline = time.monotonic() + 120
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.1)


if __name__ == "__main__":
    main()
