"""Worker for the restart test: rank 1 fails (exit 3) on the first FAIL_ATTEMPTS attempts of
the worker group; every rank succeeds after that."""

import os
import sys

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    dist.barrier()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if dist.get_rank() == 1 and attempt < int(os.environ.get("FAIL_ATTEMPTS", "2")):
        sys.stdout.flush()
        os._exit(3)  # no teardown: the peer sees a failed rank, not a clean exit
    dist.barrier()
    print(f"attempt {attempt} ok on rank {dist.get_rank()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
