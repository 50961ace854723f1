"""Does a new DDP process reduce its first step's gradients bitwise as later steps? (It does not
on more than 2 ranks: why a 4-rank DDP resume is not bitwise.)

    .venv/bin/python benchmarks/ddp_first_step.py [--nproc 4]

Starts ``--nproc`` Gloo workers under torchrun. Each wraps the same 12-layer MLP in DDP (0.5 MiB
buckets), then runs three backward passes on the same input and parameters (no optimizer step)
and keeps the all-reduced gradients of each. Printed per DDP setting: whether pass 1 equals
pass 2 and pass 2 equals pass 3, bitwise, and DDP's bucket layout after the passes.

DDP all-reduces its first pass in one bucket in parameter order, then rebuilds its buckets in
the order gradients became ready; on more than 2 ranks the ring all-reduce's summation order
depends on where an element lies in the buffer, so the first pass of every new process sums in
another order than the later passes: a resumed run's first step is not the step the
uninterrupted run took. ``find_unused_parameters=True`` keeps one layout for the process's
life (and costs a graph search and a used-parameter all-reduce per step).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def worker(find_unused: bool) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(12)]
    model = nn.Sequential(*blocks, nn.Linear(256, 10))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.5, find_unused_parameters=find_unused)
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(8, 256)
    grads = []
    for _ in range(3):
        ddp.zero_grad(set_to_none=True)
        ddp(x).pow(2).sum().backward()
        grads.append(
            torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        )
    if dist.get_rank() == 0:
        data = ddp._get_ddp_logging_data()
        layout = data.get("rebuilt_per_bucket_param_indices", "never rebuilt")
        print(
            f"find_unused_parameters={find_unused}: pass1 == pass2 {torch.equal(grads[0], grads[1])}, "
            f"pass2 == pass3 {torch.equal(grads[1], grads[2])}, "
            f"max |pass1 - pass2| {(grads[0] - grads[1]).abs().max().item():.1e}, "
            f"buckets after pass 1: {layout}",
            flush=True,
        )
    dist.destroy_process_group()
    os._exit(0)  # a Gloo worker can abort in interpreter teardown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--worker", choices=["default", "find_unused"])
    args = parser.parse_args()
    if args.worker:
        worker(args.worker == "find_unused")
        return
    for setting in ("default", "find_unused"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={args.nproc}", __file__, "--worker", setting]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
