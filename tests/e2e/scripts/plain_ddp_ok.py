"""A plain torch.distributed script: the launcher must run it unchanged.

Prints the environment the launcher promised (OMP_NUM_THREADS, MESHRUN_CONFIG) so the
test can check it, one ``key=value`` per line.
"""

import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    # 1 + 2 + ... + world
    assert value.item() == world * (world + 1) / 2, value
    lines = (
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}\n"
        f"MESHRUN_CONFIG={os.environ.get('MESHRUN_CONFIG', '')}\n"
        f"all_reduce ok on rank {dist.get_rank()} of {world}\n"
    )
    # The ranks share one stdout, unprefixed (as under torchrun): one rank at a time, one
    # write each, so that their lines cannot interleave.
    for rank in range(world):
        if rank == dist.get_rank():
            sys.stdout.write(lines)
            sys.stdout.flush()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
