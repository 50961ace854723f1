"""Worker for the Ctrl-C test: joins the group, says it is ready, then waits to be stopped."""

import os
import time

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    dist.barrier()  # both ranks are up before the test interrupts the launcher
    print(f"ready pid={os.getpid()}", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
