"""What timing DDP's gradient all-reduce costs (monitor.comm_timing, monitor/comm.py).

    .venv/bin/python benchmarks/comm_timing.py [--pairs 8] [--steps 10] [--buckets 8]

Two figures:

1. Per bucket, in one process: the wrapper's own cost (two clock reads, a lock, a list
   append, one extra ``Future.then``), as the difference between calling the timed hook and
   the bare hook on an already-completed future, 20,000 times each, interleaved in 10 rounds.
2. End to end, 2 Gloo processes: an MLP trained with three DDP copies of the same model, A
   with the timed ``allreduce_hook`` (what meshrun registers), B with DDP's built-in C++
   all-reduce (no hook), C with the untimed ``allreduce_hook``, switching A B C every
   ``--steps`` steps; per block the median step time, per round the ratios; the median over
   rounds. The machine's load (printed) makes these ratios noisy; figure 1 bounds the
   timer's own cost directly.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.monitor.comm import CommTimer


def per_bucket_cost_us(calls: int = 20_000, rounds: int = 10) -> float:
    """Median over rounds of (timed - bare) per call, in microseconds."""
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(torch.ones(1))

    def bare(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        return done.then(lambda f: f.value())  # a hook returns a fresh chained future

    timer = CommTimer(torch.device("cpu"))
    timed = timer.wrap(bare)
    diffs = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            bare(None, None)
        t1 = time.perf_counter()
        for _ in range(calls):
            timed(None, None)
        t2 = time.perf_counter()
        timer.backward_ends()
        timer.take()
        diffs.append(((t2 - t1) - (t1 - t0)) / calls * 1e6)
    return statistics.median(diffs)


def build(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def worker(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    width, depth = 512, args.buckets
    cap_mb = width * width * 4 / 2**20  # about one layer per bucket
    timer = CommTimer(torch.device("cpu"))
    a = DDP(build(width, depth), bucket_cap_mb=cap_mb)
    a.register_comm_hook(a.process_group, timer.wrap(default_hooks.allreduce_hook))
    b = DDP(build(width, depth), bucket_cap_mb=cap_mb)
    c = DDP(build(width, depth), bucket_cap_mb=cap_mb)
    c.register_comm_hook(c.process_group, default_hooks.allreduce_hook)
    x = torch.randn(64, width)
    ratios: dict[str, list[float]] = {"A/B": [], "C/B": [], "A/C": []}
    exposed = []
    for _ in range(args.pairs):
        blocks = {}
        for name, model in (("A", a), ("B", b), ("C", c)):
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                model(x).square().mean().backward()
                timer.backward_ends()
                times.append(time.perf_counter() - t0)
                if name == "A":
                    exposed.append(timer.take()["comm_exposed_s"] / times[-1])
            blocks[name] = statistics.median(times)
        for key in ratios:
            ratios[key].append(blocks[key[0]] / blocks[key[2]])
    if rank == 0:
        out.put((ratios, statistics.median(exposed)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=8, help="rounds of A B C")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--buckets", type=int, default=8)
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"wrapper cost per bucket: {per_bucket_cost_us():.2f} us (median of 10 rounds)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    ratios, exposed = out.get(timeout=600)
    for proc in procs:
        proc.join()
    print(f"{args.buckets} buckets; exposed share of the step in A: {exposed:.1%}")
    for key, label in (
        ("A/B", "timed allreduce_hook / built-in C++ all-reduce"),
        ("C/B", "untimed allreduce_hook / built-in (the Python hook itself)"),
        ("A/C", "timed / untimed allreduce_hook (the timer)"),
    ):
        r = ratios[key]
        print(
            f"{key} step time ({label}): median {statistics.median(r):.3f} over {len(r)} "
            f"rounds (range {min(r):.3f}-{max(r):.3f})"
        )


if __name__ == "__main__":
    main()
