"""One measured run of a layout in its own spawned world of Gloo processes, for the layout
benchmarks (benchmarks/layouts.py, benchmarks/moe_ep.py): each run's peak RSS is its own, and
the figures are the slowest rank's (a step ends when the slowest rank ends it)."""

from __future__ import annotations

import json
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshrun.parallel.report import state_bytes
from meshrun.runtime.hostmem import set_mmap_threshold
from meshrun.runtime.ports import free_port

KEYS = ("step_s", "bytes", "rss")
# train(rank, layout, args) -> the rank's figures (timed_steps's dict)
Train = Callable[[int, dict[str, Any], Any], dict[str, Any]]


def timed_steps(
    forward_backward: Callable[[], None], opt: torch.optim.Optimizer, steps: int, skip: int
) -> dict[str, Any]:
    """``steps`` optimizer steps: the median step time after ``skip`` warm-up steps, the model
    state this rank holds (parameters, gradients and optimizer state, while the gradients
    are still held) and the process's peak RSS."""
    times, nbytes = [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        forward_backward()
        opt.step()
        nbytes = sum(state_bytes(opt))  # gradients still held
        opt.zero_grad(set_to_none=True)
        dist.barrier()  # the step ends when the slowest rank ends it
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"step_s": statistics.median(times[skip:]), "bytes": nbytes, "rss": rss}


def _worker(
    rank: int, world: int, port: int, train: Train, layout: dict[str, Any], args: Any, out: str
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    # job.cpu_mmap_threshold_kib, as meshrun.init() sets it (0: glibc's default)
    set_mmap_threshold(getattr(args, "mmap_threshold_kib", 0))
    dist.init_process_group("gloo")
    result = train(rank, layout, args)
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # a Gloo worker can abort in interpreter teardown (see tests/_dist.py)


def run_world(world: int, train: Train, layout: dict[str, Any], args: Any) -> dict[str, float]:
    """``train`` on ``world`` fresh processes; each figure the maximum over the ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/r"
        mp.spawn(_worker, args=(world, free_port(), train, layout, args, out), nprocs=world)
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    return {k: max(r[k] for r in ranks) for k in KEYS}
