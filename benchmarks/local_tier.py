"""Restore time: the node-local checkpoint tier against the shared-storage path, same state.

    .venv/bin/python benchmarks/local_tier.py [--params 25e6] [--nproc 2] [--repeats 5]
        [--dir /tmp/meshrun-local-bench] [--local-dir /dev/shm/meshrun-local-bench] [--cold]

N ranks (DDP on Gloo), each its own simulated node (``checkpoint.local_ranks_per_node = 1``),
a stack of Linear layers with AdamW state. Step 1 is saved to the shared checkpoint directory
(``--dir``, DCP shards + manifest), step 2 as a node-local snapshot (``--local-dir``, RAM disk
by default, replicated to the next rank). Then, interleaved ``--repeats`` times, every rank
restores (timed on rank 0 between barriers, median reported):

- ``shared``: what auto-resume does without the tier: rank 0 validates the newest checkpoint
  (manifest, SHA-256 of every shard), every rank loads it with DCP and restores the rest;
- ``local``: the tier's path: the agreement (one all-gather), each rank reads its own shard
  from its node's directory (``torch.load(weights_only=True)``) and loads it;
- ``local, rank 1 from its peer``: rank 1's node lost its shard (deleted before the restore),
  it is sent by the rank that keeps the replica, written back and loaded.

``--cold`` drops the page cache before every restore (root only): the shared read then comes
from the disk, as after a reboot or from a network file system whose client cache is cold;
without it the shared files are read from the page cache (the best case for the shared path).
The local tier on /dev/shm is memory either way.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import meshrun
from meshrun.checkpoint.local.rules import shard_name, step_name
from meshrun.checkpoint.resume import Resume

WIDTH = 1024


def build_model(params: float) -> nn.Module:
    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def timed(fn: Callable[[], object], cold: bool) -> float:
    if cold and dist.get_rank() == 0:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.metrics.progress = (
        str(Path(args.dir) / "run"),
        "cpu",
        False,
    )
    cfg.checkpoint.dir, cfg.checkpoint.keep_last = str(Path(args.dir) / "shared"), 1
    cfg.checkpoint.local_interval, cfg.checkpoint.local_ranks_per_node = 2, 1
    cfg.checkpoint.local_dir = f"{args.local_dir}/node{{node}}"
    cfg.data.global_batch, cfg.data.micro_batch = world, 1
    cfg.optim.steps = 2
    run = meshrun.init(cfg, argv=[])
    model = run.parallelize(build_model(args.params))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run.resume(model, opt)
    for _ in range(2):  # step 1: the shared checkpoint; step 2: the node-local snapshot
        model(torch.randn(1, WIDTH)).sum().backward()
        run.optimizer_step(opt)
        if run.step == 1:
            run.save_checkpoint()
    ck = run._parts.checkpointer
    assert ck.local is not None
    shared = Resume(ck.cfg, ck.facts, ck.targets)
    own = ck.local.node_dir / ck.local.history / step_name(2) / shard_name(rank)

    tier = ck.local

    def from_shared() -> None:
        expect(shared.load(), 1)

    def from_local() -> None:
        expect(tier.resume(shared.load), 2)

    def from_peer() -> None:
        if rank == 1:
            own.unlink()  # this node lost its shard: the restore fetches it back
        dist.barrier()
        from_local()

    variants = {
        "shared": from_shared,
        "local": from_local,
        "local, rank 1 from its peer": from_peer,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            times[name].append(timed(fn, args.cold))
    state_bytes = own.stat().st_size
    if rank == 0:
        report(times, state_bytes, sum(p.numel() for p in model.parameters()), world, args)
    run.close()


def expect(step: int | None, wanted: int) -> None:
    if step != wanted:  # a benchmark of the wrong restore would be worse than none
        raise AssertionError(f"restored step {step}, expected {wanted}")


def report(
    times: dict[str, list[float]], nbytes: int, nparams: int, world: int, args: argparse.Namespace
) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    cache = (
        "page cache dropped before each restore" if args.cold else "shared files in the page cache"
    )
    print(
        f"\n{nparams / 1e6:.0f}M parameters + AdamW, {nbytes / 1e6:.0f} MB per rank, {world} ranks, "
        f"median of {args.repeats} ({cache})"
    )
    print(f"{'restore':<32}{'seconds':>10}{'vs shared':>11}")
    for k, s in med.items():
        print(f"{k:<32}{s:>10.3f}{med['shared'] / s:>10.1f}x")
    print(f"shared / local = {med['shared'] / med['local']:.1f}x; all runs: {times}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=25e6)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dir", default="/tmp/meshrun-local-bench")
    p.add_argument("--local-dir", default="/dev/shm/meshrun-local-bench")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each restore")
    args = p.parse_args()
    for d in (args.dir, args.local_dir):
        shutil.rmtree(d, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(worker, args=(args.nproc, port, args), nprocs=args.nproc)
    finally:
        for d in (args.dir, args.local_dir):
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
