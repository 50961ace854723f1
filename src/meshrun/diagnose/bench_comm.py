"""``meshrun bench comm``'s measurements, run in every worker: the collectives over a sweep of
message sizes (the slowest rank's time; bandwidths by diagnose/calibration.py) and the
send/recv matrix of every pair of nodes. The timing helpers serve diagnose/bench_compute.py
too."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from meshrun.diagnose.calibration import bus_bandwidth, message_sizes


def timed(fn: Callable[[], Any], seconds: float, sync: Callable[[], None]) -> float:
    """Median seconds per call of ``fn`` over about ``seconds`` (after one warm-up call).
    Only for local work: ranks would stop after different numbers of calls."""
    fn()
    sync()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 200):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_collective(fn: Callable[[], Any], seconds: float, device: Any) -> float:
    """Seconds per call of a collective, the slowest rank's. Every rank must issue the same
    number of calls (else one waits forever for a partner), so the count is agreed first:
    from the slowest rank's warm-up time."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    first = torch.tensor([time.perf_counter() - start], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    calls = int(min(200, max(3, seconds / max(float(first), 1e-6))))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    total = torch.tensor([(time.perf_counter() - start) / calls], device=device)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return float(total)


def bench_comm(device: Any, max_bytes: int, seconds: float) -> list[dict[str, Any]]:
    """Every op at every size; the time of the slowest rank (a collective ends when all do)."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for size in message_sizes(max_bytes):
        numel = max(size // 4 // n * n, n)  # fp32 elements, divisible by n
        full = torch.ones(numel, device=device)
        part = torch.empty(numel // n, device=device)
        out = torch.empty(numel, device=device)
        ops = _ops(full, part, out, rank)
        for op, fn in ops.items():
            t = timed_collective(fn, seconds, device)
            alg, bus = bus_bandwidth(op, numel * 4, t, n)
            rows.append({"op": op, "bytes": numel * 4, "time_s": t, "algbw": alg, "busbw": bus})
    return rows


def gather_scatter() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The all-gather and reduce-scatter into one tensor: torch 2.13 renamed them (the old
    names warn); older torch has only the old ones."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return gather, scatter


def _ops(full: Any, part: Any, out: Any, rank: int) -> dict[str, Callable[[], Any]]:
    import torch.distributed as dist

    gather, scatter = gather_scatter()
    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: gather(out, part),
        "reduce_scatter": lambda: scatter(part, full),
        "all_to_all": lambda: dist.all_to_all_single(out, full),
        "send_recv": lambda: _send_recv(full, rank),
    }


def _send_recv(buf: Any, rank: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        dist.send(buf, 1)
        dist.recv(buf, 1)
    elif rank == 1:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def bench_pairs(device: Any, nbytes: int, seconds: float) -> dict[str, Any]:
    """Send/recv bandwidth of every pair of nodes (their lowest ranks), or of every pair of
    ranks when all run on one node, one pair at a time while the others wait: a matrix in
    which a slow link stands out. Entry [i][j] = bytes / (round trip / 2), bytes/s."""
    import socket

    import torch
    import torch.distributed as dist

    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    nodes = list(dict.fromkeys(hosts))
    if len(nodes) > 1:
        members, labels = [hosts.index(h) for h in nodes], nodes
    else:
        members, labels = list(range(len(hosts))), [f"rank {r}" for r in range(len(hosts))]
    buf = torch.ones(max(nbytes // 4, 1), device=device)
    matrix = [[0.0] * len(members) for _ in members]
    for i, a in enumerate(members):
        for j in range(i + 1, len(members)):
            t = _ping_pong(buf, a, members[j], seconds, device)
            matrix[i][j] = matrix[j][i] = buf.numel() * 4 / (t / 2)
    return {"labels": labels, "ranks": members, "bytes": buf.numel() * 4, "bw": matrix}


def _ping_pong(buf: Any, a: int, b: int, seconds: float, device: Any) -> float:
    """Seconds per round trip between ranks ``a`` and ``b`` (every rank calls it; the others
    only wait). The count is fixed from the warm-up round trip, agreed by all ranks."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()

    def trip() -> None:
        if rank == a:
            dist.send(buf, b)
            dist.recv(buf, b)
        elif rank == b:
            dist.recv(buf, a)
            dist.send(buf, a)

    dist.barrier()
    start = time.perf_counter()
    trip()
    first = torch.tensor([time.perf_counter() - start if rank == a else 0.0], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    calls = int(min(100, max(3, seconds / max(float(first), 1e-6))))
    start = time.perf_counter()
    for _ in range(calls):
        trip()
    took = torch.tensor(
        [(time.perf_counter() - start) / calls if rank == a else 0.0], device=device
    )
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)
