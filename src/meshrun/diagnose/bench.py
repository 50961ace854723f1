"""``meshrun bench comm|compute|all``: measure this machine through ``meshrun launch`` and write
the calibration file that ``meshrun plan --calibration`` reads. (``meshrun bench data``, the
loader alone, is mounted here from data/cli.py.)

- ``comm``: all-reduce, all-gather, reduce-scatter, all-to-all and send/recv (ranks 0 <-> 1)
  over a sweep of message sizes; algorithm bandwidth S/t and bus bandwidth by the nccl-tests
  formulas (all-reduce x 2(n-1)/n, all-gather/reduce-scatter/all-to-all x (n-1)/n).
  Then two layer-level cases: ``bench_tp`` (DTensor's cost per tensor-parallel linear layer)
  and ``bench_fsdp`` (FSDP2's cost per unit collective), beyond what the sweep predicts.
- ``compute``: square matmul FLOP/s at the chosen precision (the peak), and the demo GPT's
  forward + backward FLOP/s (Megatron formula FLOPs / time), whose ratio to the peak is the
  achievable fraction the planner calls ``compute_efficiency``.

The parent writes a config and starts the workers with torchrun's agent (``launch_local``);
rank 0 merges its results into the calibration file (so ``bench compute`` then ``bench comm``
accumulate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MODULE = "meshrun.diagnose.bench"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# nccl-tests bus-bandwidth factors: busbw = algbw x factor(n).
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}


def bus_bandwidth(op: str, nbytes: float, seconds: float, n: int) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in bytes/s of one collective on ``n`` ranks."""
    alg = nbytes / seconds
    return alg, alg * BUS_FACTOR[op](n)


# Ring steps per call (alpha-beta model): all-reduce 2(n-1), all-gather/reduce-scatter n-1.
RING_STEPS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2.0 * (n - 1),
    "all_gather": lambda n: n - 1.0,
    "reduce_scatter": lambda n: n - 1.0,
}


def fit_collectives(rows: Sequence[dict[str, Any]], n: int) -> dict[str, float]:
    """Fit the alpha-beta model t = steps(n) * alpha + busbw_factor(n) * S / busbw_op to the
    measured all-reduce, all-gather and reduce-scatter rows: one latency per ring step
    (``latency``) and one bus bandwidth per op (``all_reduce``, ...), by least squares on the
    relative error (so 4 KiB and 16 MiB weigh alike). A negative latency (noise) is refitted
    as 0."""
    import numpy as np

    ops = [op for op in RING_STEPS if any(r["op"] == op for r in rows)]
    used = [r for r in rows if r["op"] in ops and r["time_s"] > 0]
    if "all_reduce" not in ops:
        raise ValueError("fit_collectives: no all_reduce rows to fit")
    a = np.zeros((len(used), 1 + len(ops)))
    y = np.ones(len(used))  # t / t: every row weighted by its own time
    for i, r in enumerate(used):
        a[i, 0] = RING_STEPS[r["op"]](n) / r["time_s"]
        a[i, 1 + ops.index(r["op"])] = r["bytes"] * BUS_FACTOR[r["op"]](n) / r["time_s"]
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    if coef[0] < 0:
        coef = np.concatenate([[0.0], np.linalg.lstsq(a[:, 1:], y, rcond=None)[0]])
    out = {"latency": float(coef[0])}
    for i, op in enumerate(ops):
        inv = float(coef[1 + i])
        # No bandwidth signal (noise swamped it): the op's best measured bus bandwidth.
        best = max(r["busbw"] for r in used if r["op"] == op)
        out[op] = 1.0 / inv if inv > 0 else best
    return out


def message_sizes(max_bytes: int, min_bytes: int = 4096) -> list[int]:
    """Powers of 4 from ``min_bytes`` up to ``max_bytes`` (inclusive of the last power)."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


# --- the parent: `meshrun bench` -----------------------------------------------------------


def cmd_bench(a: argparse.Namespace) -> int:
    from meshrun.config import Config, ConfigError, write_config
    from meshrun.launch.local import LaunchSpec, default_nproc_per_node, launch_local

    nproc = a.nproc_per_node or default_nproc_per_node()
    if nproc < 2 and a.kind in ("comm", "all"):
        raise ConfigError(f"--nproc-per-node {nproc}: bench comm needs at least 2 processes")
    if a.max_mb <= 0:
        raise ConfigError(f"--max-mb {a.max_mb}: must be > 0")
    cfg = Config()
    cfg.job.name, cfg.job.run_dir = "bench", a.run_dir
    cfg.data.micro_batch, cfg.data.global_batch = 1, nproc
    cfg.metrics.progress = False
    config_path = write_config(cfg, Path(a.run_dir) / "config.toml")
    args = ["--kind", a.kind, "--out", str(Path(a.out).resolve()), "--max-mb", str(a.max_mb),
            "--precision", a.precision, "--seconds", str(a.seconds)]  # fmt: skip
    if getattr(a, "pairs", False):
        args += ["--pairs", "--pair-mb", str(a.pair_mb)]
    spec = LaunchSpec(nproc_per_node=nproc, module=MODULE, script_args=args,
                      config_path=str(config_path), run_dir=a.run_dir)  # fmt: skip
    code = launch_local(spec)
    if code == 0:
        print(f"wrote {a.out}; use it with `meshrun plan --calibration {a.out} ...`")
    return code


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from meshrun.data.cli import add_bench_data

    p = sub.add_parser(
        "bench",
        help="measure links, compute and the data loader (links and compute: a calibration file)",
        description="Run collectives over a sweep of message sizes (comm) and matmul plus the "
        "demo GPT's step (compute) in N processes started by torchrun's agent; rank 0 writes "
        "the calibration file that `meshrun plan --calibration` reads (docs/plan.md). `data`: "
        "samples/s of the data loader alone, per rank (docs/data.md).",
    )
    kinds = p.add_subparsers(dest="kind", required=True, metavar="{comm,compute,all,data}")
    common = argparse.ArgumentParser(add_help=False)
    _add_calibration_options(common)
    for kind, help in (("comm", "collectives over a sweep of message sizes"),
                       ("compute", "matmul and the demo GPT's step, FLOP/s"),
                       ("all", "comm and compute")):  # fmt: skip
        k = kinds.add_parser(kind, help=help, parents=[common])
        k.set_defaults(fn=cmd_bench)
        if kind != "compute":
            k.add_argument("--pairs", action="store_true", help="also measure every pair of "
                           "nodes (of ranks on one node) alone: a matrix, to find a slow link")  # fmt: skip
            k.add_argument("--pair-mb", type=float, default=4.0,
                           help="message per pair and direction, MiB (4)")  # fmt: skip
    add_bench_data(kinds, "data")


def _add_calibration_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc-per-node", type=int, help="processes (default: GPUs, else 2)")
    p.add_argument("--out", default="calibration.json", help="calibration file (merged into)")
    p.add_argument("--max-mb", type=float, default=16.0, help="largest message, MiB (16)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="matmul precision (fp32; bf16/fp16 on GPUs)")  # fmt: skip
    p.add_argument("--seconds", type=float, default=0.3, help="time per measurement (0.3)")
    p.add_argument("--run-dir", default="runs/bench", help="logs and config (runs/bench)")


# --- the workers ---------------------------------------------------------------------------


def _timed(fn: Callable[[], Any], seconds: float, sync: Callable[[], None]) -> float:
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


def _timed_collective(fn: Callable[[], Any], seconds: float, device: Any) -> float:
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
            t = _timed_collective(fn, seconds, device)
            alg, bus = bus_bandwidth(op, numel * 4, t, n)
            rows.append({"op": op, "bytes": numel * 4, "time_s": t, "algbw": alg,
                         "busbw": bus})  # fmt: skip
    return rows


def _ops(full: Any, part: Any, out: Any, rank: int) -> dict[str, Callable[[], Any]]:
    import torch.distributed as dist

    global _ALL_GATHER, _REDUCE_SCATTER
    # torch 2.13 renamed them (the old names warn); older torch has only the old ones.
    _ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: _ALL_GATHER(out, part),
        "reduce_scatter": lambda: _REDUCE_SCATTER(part, full),
        "all_to_all": lambda: dist.all_to_all_single(out, full),
        "send_recv": lambda: _send_recv(full, rank),
    }


_ALL_GATHER: Callable[..., Any]
_REDUCE_SCATTER: Callable[..., Any]


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
    took = torch.tensor([(time.perf_counter() - start) / calls if rank == a else 0.0],
                        device=device)  # fmt: skip
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def slow_pairs(bw: Sequence[Sequence[float]], factor: float = 0.5) -> list[tuple[int, int]]:
    """The pairs whose bandwidth is below ``factor`` x the median of all pairs."""
    values = [bw[i][j] for i in range(len(bw)) for j in range(i + 1, len(bw))]
    if not values:
        return []
    median = statistics.median(values)
    return [(i, j) for i in range(len(bw)) for j in range(i + 1, len(bw))
            if bw[i][j] < factor * median]  # fmt: skip


def pairs_report(pairs: dict[str, Any]) -> list[str]:
    """The matrix in GB/s, then each slow link named (or a line saying there is none)."""
    labels, bw = pairs["labels"], pairs["bw"]
    width = max(8, *(len(x) for x in labels)) + 1
    lines = [f"send/recv bandwidth between pairs, {pairs['bytes'] / 2**20:g} MiB each way, GB/s:",
             " " * width + "".join(f"{x:>{width}}" for x in labels)]  # fmt: skip
    for i, row in enumerate(bw):
        cells = "".join(f"{'-':>{width}}" if i == j else f"{v / 1e9:>{width}.3f}"
                        for j, v in enumerate(row))  # fmt: skip
        lines.append(f"{labels[i]:>{width}}{cells}")
    values = [bw[i][j] for i in range(len(bw)) for j in range(i + 1, len(bw))]
    slow = slow_pairs(bw)
    for i, j in slow:
        lines.append(f"slow link: {labels[i]} <-> {labels[j]} at {bw[i][j] / 1e9:.3f} GB/s, "
                     f"{bw[i][j] / statistics.median(values):.2f}x the median of all pairs")  # fmt: skip
    if values and not slow:
        lines.append(f"no slow link: every pair within 2x of the median "
                     f"{statistics.median(values) / 1e9:.3f} GB/s")  # fmt: skip
    return lines


TP_BENCH_BLOCKS = 4  # MLP pairs in the stack bench_tp splits
# Its input: the demo GPT's micro-batch of bench_compute (8 x 128 tokens, hidden 256), so that
# the ranks compute as long between two all-reduces as in a real block (and drift as far).
TP_BENCH_TOKENS = 8 * 128
TP_BENCH_HIDDEN = 256


def bench_tp(device: Any, seconds: float) -> dict[str, float]:
    """The cost per tensor-parallel linear layer, forward + backward, beyond its math and its
    all-reduce.

    A stack of MLP pairs (up ColwiseParallel, down RowwiseParallel: Megatron's layout, as
    meshrun's default plan) split over all ranks by ``parallelize_module``, at the demo GPT's
    size (as bench_compute's model), against the same local shards as plain modules; each pair
    issues two all-reduces (its output forward, its input gradient backward), timed alone
    (back to back) and taken out, so ``tp_layer_overhead`` = (t_tp - t_local - 2 x pairs x
    t_all_reduce) / (2 x pairs) is DTensor's dispatch (from_local/to_local, redistribute,
    autograd wrappers) plus the waiting at each all-reduce for the partner that drifted (on a
    CPU, a process woken after the others). Also returned: the three times, for the record."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = dist.get_world_size()
    h = -(-TP_BENCH_HIDDEN // n) * n  # divisible by the group
    plan: dict[str, Any] = {}
    for i in range(TP_BENCH_BLOCKS):
        plan[f"{i}.0"], plan[f"{i}.1"] = ColwiseParallel(), RowwiseParallel()
    mesh = init_device_mesh(device.type, (n,))
    split = parallelize_module(_mlp_stack(h, 4 * h, device), mesh, plan)
    local = _mlp_stack(h, 4 * h // n, device)
    # The input wants a gradient, so the first pair also all-reduces its input's, as in a block.
    x = torch.randn(TP_BENCH_TOKENS, h, device=device, requires_grad=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    buf = torch.ones(TP_BENCH_TOKENS * h, device=device)
    rounds = []
    for _ in range(3):  # interleaved rounds, medians (as bench_compute): the load moves
        t_tp = _timed_collective(lambda: split(x).sum().backward(), seconds, device)
        t_local = _timed(lambda: local(x).sum().backward(), seconds, sync)
        t_ar = _timed_collective(lambda: dist.all_reduce(buf), seconds, device)
        rounds.append((t_tp, t_local, t_ar))
    linears = 2 * TP_BENCH_BLOCKS
    extra = statistics.median((tp - lo - linears * ar) / linears for tp, lo, ar in rounds)
    t_tp, t_local, t_ar = (statistics.median(r[i] for r in rounds) for i in range(3))
    return {"tp_layer_overhead": max(0.0, extra), "tp_stack_s": t_tp, "local_stack_s": t_local,
            "all_reduce_s": t_ar}  # fmt: skip


def _mlp_stack(h: int, inner: int, device: Any) -> Any:
    from torch import nn

    blocks = [nn.Sequential(nn.Linear(h, inner, bias=False), nn.Linear(inner, h, bias=False))
              for _ in range(TP_BENCH_BLOCKS)]  # fmt: skip
    return nn.Sequential(*blocks).to(device)


FSDP_BENCH_BLOCKS = 2  # demo-GPT blocks in the stack bench_fsdp shards (cost: per collective)


def bench_fsdp(device: Any, seconds: float) -> dict[str, float]:
    """The cost per collective FSDP2 issues (a unit's all-gather or reduce-scatter), forward +
    backward, beyond its bytes and ring steps, its modelled copies and the math.

    A stack of demo-GPT blocks ("small") with ``fully_shard`` on each (ZeRO-3: resharded after
    forward, so every block all-gathers in forward and in backward and reduce-scatters: 3
    collectives per block), over all ranks, on bench_compute's micro-batch (8 x 128 tokens),
    against the same blocks unsharded as plain modules; one block's all-gather and
    reduce-scatter timed alone (back to back) and a 64 MiB copy (the planner's ``mem_bw``)
    taken out, so ``fsdp_unit_overhead`` = (t_fsdp - t_local - blocks x (2 t_ag + t_rs) -
    copies) / (3 x blocks), copies = 2 (1 + 1/n) x the gathered and reduced bytes / mem_bw as
    in the planner. What is left: FSDP2's per-unit hooks and DTensor bookkeeping and, on a
    CPU, the wait at each blocking collective for the slower rank. Also returned: the times."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    n = dist.get_world_size()
    torch.manual_seed(0)  # the same blocks on every rank (fully_shard shards what it is given)
    sharded, local = _block_stack(device), _block_stack(device)
    block_bytes = sum(p.numel() * p.element_size() for p in local[0].parameters())
    mesh = init_device_mesh(device.type, (n,))
    for block in sharded:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(sharded, mesh=mesh)
    x = torch.randn(8, 128, local[0].mlp_norm.normalized_shape[0], device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    numel = -(-block_bytes // 4 // n) * n  # one block's fp32 elements, divisible by n
    full, part = torch.ones(numel, device=device), torch.empty(numel // n, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    big = torch.empty(2**24, device=device)
    copy = torch.empty_like(big)
    rounds = []
    for _ in range(3):  # interleaved rounds, medians (as bench_tp): the load moves
        t_fsdp = _timed_collective(lambda: sharded(x).sum().backward(), seconds, device)
        t_local = _timed(lambda: local(x).sum().backward(), seconds, sync)
        t_ag = _timed_collective(lambda: gather(full, part), seconds, device)
        t_rs = _timed_collective(lambda: scatter(part, full), seconds, device)
        mem_bw = 2.0 * big.numel() * 4 / _timed(lambda: copy.copy_(big), seconds, sync)
        rounds.append((t_fsdp, t_local, t_ag, t_rs, mem_bw))
    blocks, bytes_ = FSDP_BENCH_BLOCKS, float(numel * 4)

    def per_collective(r: tuple[float, ...]) -> float:
        t_fsdp, t_local, t_ag, t_rs, mem_bw = r
        copies = 2.0 * (1.0 + 1.0 / n) * 3 * blocks * bytes_ / mem_bw
        return (t_fsdp - t_local - blocks * (2 * t_ag + t_rs) - copies) / (3 * blocks)

    extra = statistics.median(per_collective(r) for r in rounds)
    keys = ("fsdp_stack_s", "local_stack_s", "all_gather_s", "reduce_scatter_s", "mem_bw")
    out = {k: statistics.median(r[i] for r in rounds) for i, k in enumerate(keys)}
    return {"fsdp_unit_overhead": max(0.0, extra), **out}


def _block_stack(device: Any) -> Any:
    from torch import nn

    from meshrun.demo.model import Block, demo_config

    cfg = demo_config("small")
    return nn.Sequential(*(Block(cfg) for _ in range(FSDP_BENCH_BLOCKS))).to(device)


def bench_compute(device: Any, precision: str, seconds: float) -> dict[str, float]:
    """Matmul FLOP/s (the peak) and the demo GPT's training FLOP/s on this rank."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    # Interleaved rounds, medians: a neighbour's load then hits both figures alike, and the
    # ratio (the achievable fraction) is steadier than either.
    matmul, model, optim = [], [], []
    for _ in range(3):
        matmul.append(2.0 * n**3 / _timed(lambda: a @ b, seconds, sync))
        model.append(_model_flops(device, seconds, sync))
        optim.append(_optimizer_bw(device, seconds, sync))
    big = torch.empty(2**24, device=device)  # 64 MiB: past every cache
    copy = torch.empty_like(big)
    mem_bw = 2.0 * big.numel() * 4 / _timed(lambda: copy.copy_(big), seconds, sync)
    return {"matmul_flops": statistics.median(matmul), "model_flops": statistics.median(model),
            "mem_bw": mem_bw, "optimizer_bw": statistics.median(optim)}  # fmt: skip


def _optimizer_bw(device: Any, seconds: float, sync: Callable[[], None]) -> float:
    """AdamW's step over the demo GPT's parameters, as the bytes per second of the planner's
    optimizer model (28 bytes per parameter): it includes the per-tensor launch costs."""
    import torch

    from meshrun.demo.model import GPT, demo_config

    cfg = demo_config("small")
    model = GPT(cfg).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    return 28.0 * params / _timed(opt.step, seconds, sync)


def _model_flops(device: Any, seconds: float, sync: Callable[[], None]) -> float:
    """The demo GPT ("small", micro-batch 8) forward + backward: formula FLOPs per second."""
    import torch

    from meshrun.demo.model import GPT, demo_config
    from meshrun.plan.cost import Model, flops_per_iteration

    cfg = demo_config("small")
    model = GPT(cfg).to(device)
    batch = 8
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)

    def step() -> None:
        model(x, x).backward()

    shape = Model(layers=cfg.n_layer, hidden=cfg.d_model, heads=cfg.n_head,
                  vocab=cfg.vocab_size, seq=cfg.seq_len, ffn=cfg.ffn_mult * cfg.d_model)  # fmt: skip
    return flops_per_iteration(shape, batch) / _timed(step, seconds, sync)


def slowest_rank_rates(values: dict[str, float], device: Any) -> dict[str, float]:
    """Each rate (FLOP/s, bytes/s) of the slowest rank: a synchronous step, whose collectives
    wait for every rank, goes at that rank's pace, not at the mean's."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return dict(zip(values, t.tolist(), strict=True))


def calibration(results: dict[str, Any], world: int, device: Any) -> dict[str, Any]:
    """The planner's rates from the measurements (keys of plan.cost.Cluster)."""
    cluster: dict[str, float] = {}
    if "compute" in results:
        c = results["compute"]
        cluster["peak_flops"] = c["matmul_flops"]
        cluster["compute_efficiency"] = min(1.0, c["model_flops"] / c["matmul_flops"])
        for key in ("mem_bw", "optimizer_bw"):
            if key in c:
                cluster[key] = c[key]
    if "comm" in results:
        fit = fit_collectives(results["comm"], world)
        # One node measured: the fitted all-reduce bus bandwidth and latency stand for both
        # links; all-gather and reduce-scatter keep their own rates as ratios to it.
        cluster["intra_bw"] = cluster["inter_bw"] = fit["all_reduce"]
        cluster["intra_latency"] = cluster["inter_latency"] = fit["latency"]
        for op in ("all_gather", "reduce_scatter"):
            if op in fit:
                cluster[f"{op}_ratio"] = fit[op] / fit["all_reduce"]
        cluster["comm_efficiency"] = 1.0
        if device.type == "cpu":
            # Gloo runs collectives on the same cores as the math: nothing hides.
            cluster["overlap"] = 0.0
    if "tp" in results and device.type == "cpu":
        # On a CPU DTensor's dispatch takes the cores the math needs; a GPU's host runs ahead
        # of its kernels, so there it stays in `measured` only (the planner's default is 0).
        cluster["tp_layer_overhead"] = results["tp"]["tp_layer_overhead"]
    if "fsdp" in results and device.type == "cpu":
        # The same on a CPU for FSDP2's per-unit hooks and blocking collectives; a GPU's
        # streams and host running ahead hide them (the planner's default, 0, stays).
        cluster["fsdp_unit_overhead"] = results["fsdp"]["fsdp_unit_overhead"]
    cluster["memory_bytes"] = _device_memory(device, world)
    return cluster


def _device_memory(device: Any, world: int) -> float:
    import torch

    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) / world


def write_calibration(path: str, results: dict[str, Any], world: int, device: Any) -> None:
    """Merge ``results`` into the calibration file at ``path`` (written atomically)."""
    p = Path(path)
    doc: dict[str, Any] = json.loads(p.read_text()) if p.is_file() else {}
    measured = {**doc.get("measured", {}), **results}
    doc = {"source": f"meshrun bench on {world} {device.type} processes",
           "cluster": {**doc.get("cluster", {}), **calibration(measured, world, device)},
           "measured": measured}  # fmt: skip
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(p)


# What each compute figure is, and its unit: FLOP/s for arithmetic, bytes/s for memory traffic.
_COMPUTE_FIGURES = {
    "matmul_flops": ("matmul (peak)", "GFLOP/s"),
    "model_flops": ("demo GPT training", "GFLOP/s"),
    "mem_bw": ("memory copy (64 MiB)", "GB/s"),
    "optimizer_bw": ("AdamW step (28 B/param)", "GB/s"),
}


def compute_lines(compute: dict[str, float]) -> list[str]:
    """``bench_compute``'s figures (slowest rank) as aligned lines, each with its unit."""
    rows = [(*_COMPUTE_FIGURES.get(key, (key, "G/s")), value) for key, value in compute.items()]
    width = max((len(label) for label, _, _ in rows), default=0)
    return ["compute, slowest rank:"] + [
        f"  {label:<{width}}  {value / 1e9:>9.2f} {unit}" for label, unit, value in rows
    ]


def _print_comm(rows: list[dict[str, Any]]) -> None:
    print(f"{'op':>15} {'bytes':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for r in rows:
        print(f"{r['op']:>15} {r['bytes']:>10} {r['time_s'] * 1e6:>10.1f} "
              f"{r['algbw'] / 1e9:>11.3f} {r['busbw'] / 1e9:>11.3f}")  # fmt: skip


def worker(argv: Sequence[str] | None = None) -> None:
    import meshrun

    p = argparse.ArgumentParser(prog=MODULE)
    p.add_argument("--kind", default="all")
    p.add_argument("--out", required=True)
    p.add_argument("--max-mb", type=float, default=16.0)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--seconds", type=float, default=0.3)
    p.add_argument("--pairs", action="store_true")
    p.add_argument("--pair-mb", type=float, default=4.0)
    a = p.parse_args(argv)
    run = meshrun.init(argv=[])
    results: dict[str, Any] = {}
    if a.kind in ("compute", "all"):
        results["compute"] = slowest_rank_rates(
            bench_compute(run.device, a.precision, a.seconds), run.device
        )
    if a.kind in ("comm", "all"):
        results["comm"] = bench_comm(run.device, int(a.max_mb * 2**20), a.seconds)
        results["tp"] = bench_tp(run.device, a.seconds)
        results["fsdp"] = bench_fsdp(run.device, a.seconds)
        if a.pairs:
            results["pairs"] = bench_pairs(run.device, int(a.pair_mb * 2**20), a.seconds)
    if run.is_main:
        if "comm" in results:
            _print_comm(results["comm"])
        if "pairs" in results:
            print("\n".join(pairs_report(results["pairs"])))
        if "tp" in results:
            print(f"tensor parallel: {results['tp']['tp_layer_overhead'] * 1e3:.3f} ms of DTensor "
                  "dispatch per linear layer (forward + backward)")  # fmt: skip
        if "fsdp" in results:
            print(f"FSDP2: {results['fsdp']['fsdp_unit_overhead'] * 1e3:.3f} ms per unit "
                  "collective beyond its bytes (hooks, waiting for the slower rank)")  # fmt: skip
        if "compute" in results:
            print("\n".join(compute_lines(results["compute"])))
        write_calibration(a.out, results, run.world_size, run.device)


if __name__ == "__main__":
    from meshrun.entry import main as _entry

    _entry(worker)(sys.argv[1:])
