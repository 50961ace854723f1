"""A plain torch.distributed worker (no meshrun import) for the killed-launcher test: rank 1
fails (exit 3) on the first attempt of the group, so the launcher restarts it; the restarted
workers say they are ready, with their PID and attempt, then sleep until stopped."""

import os
import sys
import time

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    dist.barrier()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()
    # One write, so the line cannot be split by the other worker's.
    sys.stdout.write(f"ready pid={os.getpid()} attempt={attempt}\n")
    sys.stdout.flush()
    time.sleep(300)


if __name__ == "__main__":
    main()
