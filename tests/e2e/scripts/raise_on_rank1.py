"""Worker for the launcher test: rank 1 fails, rank 0 waits in a barrier and becomes a victim.

Decorated with torch's ``@record`` so the failing rank writes its traceback to the
elastic error file, which the launcher's failure summary reads.
"""

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def load_shard_for_rank1() -> None:
    # A nested frame, so the test can check the summary shows the real traceback.
    raise RuntimeError("boom from rank 1")


@record
def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    if dist.get_rank() == 1:
        load_shard_for_rank1()
    dist.barrier()  # rank 0 blocks here until the agent stops it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
