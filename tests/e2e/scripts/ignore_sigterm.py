"""Worker for the SIGTERM test: ignores SIGTERM (as a worker busy saving a checkpoint may for
a long while), says it is ready, then sleeps."""

import os
import signal
import sys
import time

import torch.distributed as dist


def main() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.init_process_group("gloo")
    dist.barrier()
    # One write, so the line cannot be split by the other worker's under PYTHONUNBUFFERED.
    sys.stdout.write(f"ready pid={os.getpid()}\n")
    sys.stdout.flush()
    time.sleep(300)


if __name__ == "__main__":
    main()
