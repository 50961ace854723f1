"""A small DDP job that checkpoints and resumes, slowed by 0.25 s a step so that a test can
take a node away mid-run (tests/e2e/test_multinode.py, the elastic case)."""

import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import meshrun


@meshrun.main
def main() -> None:
    run = meshrun.init()
    x = torch.randn(1536, 16, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x @ torch.randn(16, 1, generator=torch.Generator().manual_seed(1)))
    model = run.parallelize(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=run.scaled_lr(1e-2))
    loader = run.dataloader(data)
    start = run.resume(model, opt, loader)
    print(f"slow_resumable: world {run.world_size}, starting at step {start}", flush=True)
    for inputs, targets in run.steps(loader):
        loss = nn.functional.mse_loss(model(inputs), targets)
        run.backward(loss)
        if run.optimizer_step(opt):
            time.sleep(0.25)  # room for the test to kill a node mid-run


if __name__ == "__main__":
    main()
