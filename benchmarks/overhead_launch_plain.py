"""The plain script of ``overhead_launch.py``: torch only, what any launcher must start.

It joins the process group, runs one all-reduce (so every rank really met the others) and
leaves; the launcher's own cost is then most of what differs between two launchers."""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
assert value.item() == dist.get_world_size(), value
dist.destroy_process_group()
# Gloo's threads can abort the interpreter's teardown (SIGABRT in 8-40% of runs measured here):
# a failed run would stop the benchmark, and both launchers would wait on it alike.
sys.stdout.flush()
os._exit(0)
