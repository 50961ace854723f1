"""A plain torch.distributed script: the launcher must run it unchanged.

Prints the environment the launcher promised (OMP_NUM_THREADS, MESHRUN_CONFIG) so the
test can check it, one ``key=value`` per line.
"""

import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    # 1 + 2 + ... + world
    assert value.item() == world * (world + 1) / 2, value
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}", flush=True)
    print(f"MESHRUN_CONFIG={os.environ.get('MESHRUN_CONFIG', '')}", flush=True)
    print(f"all_reduce ok on rank {dist.get_rank()} of {world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
