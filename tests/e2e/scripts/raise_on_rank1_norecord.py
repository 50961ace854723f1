"""Like raise_on_rank1.py but without ``@record``: the traceback only reaches stderr.

The launcher's summary must then fall back to the tail of the rank's stderr log.
"""

from datetime import timedelta

import torch.distributed as dist


def load_shard_for_rank1() -> None:
    raise RuntimeError("boom from rank 1")


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    if dist.get_rank() == 1:
        load_shard_for_rank1()
    dist.barrier()  # rank 0 blocks here until the agent stops it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
