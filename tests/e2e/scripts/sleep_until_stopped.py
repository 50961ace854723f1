"""Worker for the Ctrl-C test: joins the group, says it is ready, then waits to be stopped."""

import os
import sys
import time

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    dist.barrier()  # both ranks are up before the test interrupts the launcher
    # One write, so the line cannot be split by the other worker's under PYTHONUNBUFFERED.
    sys.stdout.write(f"ready pid={os.getpid()}\n")
    sys.stdout.flush()
    time.sleep(120)


if __name__ == "__main__":
    main()
