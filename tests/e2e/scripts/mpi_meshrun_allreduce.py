"""``meshrun.init()`` under an MPI launcher, then one all-reduce over the group it made.

Prints, per rank, one line the test reads: the launcher meshrun detected, rank 0's endpoint
and the all-reduced sum (1 + 2 + ... + world when every rank joined the same group).
"""

import torch
import torch.distributed as dist

import meshrun

run = meshrun.init()
value = torch.tensor([float(run.rank + 1)])
dist.all_reduce(value)
env = run.cluster
print(
    f"rank {run.rank} of {run.world_size} [{env.kind}] master {env.master_addr}:"
    f"{env.master_port} local {env.local_rank}/{env.local_world_size} sum {value.item():g}",
    flush=True,
)
run.close()
