"""Prints deterministic lines from every rank, in rank order, for byte comparisons of
``torchrun`` and ``meshrun launch`` output (no meshrun import: a plain torchrun script).

One line per rank on stdout, written and flushed before a barrier lets the next rank write,
so the order in the file is fixed; one line per rank on stderr (its order is not compared).
"""

import os
import sys

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = (
        "LOCAL_RANK",
        "GROUP_RANK",
        "LOCAL_WORLD_SIZE",
        "ROLE_NAME",
        "TORCHELASTIC_MAX_RESTARTS",
    )
    for turn in range(world):
        if turn == rank:
            print(f"rank {rank}/{world} " + " ".join(f"{k}={os.environ[k]}" for k in keys))
            print(f"rank {rank} says: no prefix on this line", flush=True)
        dist.barrier()
    print(f"rank {rank} on stderr", file=sys.stderr, flush=True)
    dist.barrier()
    if rank == 0:
        print("done", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    # Gloo's teardown can abort the process at interpreter exit ("terminate called without
    # an active exception"); nothing is left to do, so leave without it.
    os._exit(0)


if __name__ == "__main__":
    main()
