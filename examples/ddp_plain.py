"""A plain PyTorch DDP script: no meshrun import. It runs unchanged under both

    torchrun --nproc-per-node 2 examples/ddp_plain.py
    meshrun launch --nproc-per-node 2 examples/ddp_plain.py

since meshrun launch runs the same torchrun elastic agent and sets the same environment.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    timeout = timedelta(seconds=float(os.environ.get("EXAMPLE_TIMEOUT_S", "300")))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(1024, 16)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            loss = nn.functional.mse_loss(model(inputs), targets)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
    # Every rank must hold identical weights after DDP training.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered), "replicas diverged"
    if rank == 0:
        print(f"ok: {world} replicas identical", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown: after destroy_process_group() a Gloo worker
    # can still abort there ("terminate called without an active exception", SIGABRT; 2 of 7
    # runs of this script under plain torchrun on a loaded machine), failing a job whose
    # training succeeded. Everything is done and flushed by now, so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
