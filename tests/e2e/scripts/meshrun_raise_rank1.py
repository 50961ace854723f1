"""A meshrun training script whose rank 1 fails at step 3 (for the failure summary test)."""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import meshrun


def check_batch(run: meshrun.Run) -> None:
    if run.rank == 1 and run.step == 2:
        raise ValueError("bad batch on rank 1 at step 3")


@meshrun.main
def main() -> None:
    run = meshrun.init()
    data = TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
    model = run.parallelize(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in run.steps(run.dataloader(data)):
        check_batch(run)
        run.backward(nn.functional.mse_loss(model(x), y))
        run.optimizer_step(opt)


if __name__ == "__main__":
    main()
