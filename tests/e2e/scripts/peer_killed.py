"""Rank 1 SIGKILLs itself after one all-reduce; rank 0 goes on and fails in its next one with
Gloo's connection error, uncaught (through ``sys.excepthook``, or ``@meshrun.main`` with the
argument ``main``)."""

import os
import signal
import sys

import torch
import torch.distributed as dist

import meshrun


def train() -> None:
    run = meshrun.init(argv=[f"--job.run_dir={os.environ['RUN_DIR']}"])
    t = torch.ones(1)
    dist.all_reduce(t)
    if run.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(100):  # the first one after the kill raises; the bound guards a hang
        dist.all_reduce(t)


if sys.argv[1:] == ["main"]:
    meshrun.main(train)()
else:
    train()
