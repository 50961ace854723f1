"""A meshrun script for the two-node Ray check: every rank trains two steps of a small model,
then rank 0 prints each rank's host, gathered over the process group Ray made."""

import socket

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import meshrun


@meshrun.main
def main() -> None:
    run = meshrun.init()
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    model = run.parallelize(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in run.steps(run.dataloader(data)):
        run.backward(nn.functional.mse_loss(model(x), y))
        run.optimizer_step(opt)
    hosts: list[str | None] = [None] * run.world_size
    dist.all_gather_object(hosts, socket.gethostname())
    if run.rank == 0:
        print(f"ranks on hosts: {','.join(str(h) for h in hosts)} ({dist.get_backend()})")
    run.close()


if __name__ == "__main__":
    main()
