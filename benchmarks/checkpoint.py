"""Checkpoint throughput: meshrun's save/resume against DCP alone and ``torch.save``/``torch.load``
of the full state on rank 0, on N ranks (DDP), with the disk's fsync'd write speed as the yardstick.

    .venv/bin/python benchmarks/checkpoint.py [--params 110e6] [--nproc 2] [--repeats 2]
        [--dir /tmp/meshrun-ckpt-bench] [--out results.json]

The model is a stack of square Linear layers with AdamW state (about 12 bytes per parameter
on disk). Every variant is timed ``--repeats`` times, interleaved, and the median is reported;
each write ends with fsync. Variants:

- ``meshrun save``: ``run.save_checkpoint()``: DCP with fsync, each rank hashing its own
  shards, manifest, COMPLETE marker, rename (the full atomic commit).
- ``dcp.save``: ``torch.distributed.checkpoint.save`` of the same tensors, nothing else.
- ``dcp.save + re-read SHA-256``: what meshrun did before it hashed while writing: ``dcp.save``,
  then each rank re-reads its own shards to hash them.
- ``torch.save rank 0``: gather the full state to rank 0 (``get_state_dict(full_state_dict=True,
  cpu_offload=True)``), ``torch.save`` it, fsync.
- ``memcpy``: a clone of the state in memory (the floor of any staging).
- ``disk``: rank 0 writes as many bytes as the checkpoint to one file with fsync (like ``dd``).
- loads: ``run.resume`` of meshrun's checkpoint (SHA-256 verified) and ``torch.load
  (weights_only=True)`` of the rank-0 file.

- ``meshrun async``: ``checkpointer.save_async`` (DCP ``async_save``; the state is copied to
  CPU memory in the stager's thread while this rank runs one forward and backward, then
  ``before_update`` waits for the copy, as ``run.optimizer_step`` does); *blocked* is the call
  plus that wait (rank 0's), *durable* the time until the checkpoint is committed (``wait``).
- ``forward+backward``: that one forward and backward alone (4 samples); ``fwd+bwd during the
  copy`` the same while the state is being copied (the copy's cost to a CPU-bound step).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

import meshrun
from meshrun.checkpoint import on_disk

WIDTH = 2048


def build_model(params: float) -> nn.Module:
    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def timed(fn: Callable[[], Any]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fsync_write(path: Path, data: bytes | None = None, nbytes: int = 0) -> None:
    with open(path, "wb") as fh:
        if data is not None:
            fh.write(data)
        else:
            block = os.urandom(16 << 20)
            for _ in range(nbytes // len(block)):
                fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())


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
    root = Path(args.dir)
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.metrics.progress = str(root / "run"), "cpu", False
    cfg.checkpoint.dir, cfg.checkpoint.resume, cfg.checkpoint.keep_last = (
        str(root / "m"),
        "never",
        1,
    )
    cfg.data.global_batch, cfg.data.micro_batch = world, 1
    run = meshrun.init(cfg, argv=[])
    model = run.parallelize(build_model(args.params))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(1, WIDTH)).sum().backward()
    opt.step()  # materialise the optimizer state
    run.resume(model, opt)
    nparams = sum(p.numel() for p in model.parameters())
    times: dict[str, list[float]] = {}
    for i in range(args.repeats):
        run._parts.state.step = i + 1  # a new step each time: save() returns early for a saved step
        times.setdefault("meshrun save", []).append(timed(run.save_checkpoint))
        run._parts.state.step += 100
        blocked, durable, overlapped = _async_save(run, model)
        times.setdefault("meshrun async: blocked", []).append(blocked)
        times.setdefault("meshrun async: durable", []).append(durable)
        times.setdefault("fwd+bwd during the copy", []).append(overlapped)
        times.setdefault("forward+backward", []).append(timed(lambda: _fwd_bwd(model)))
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd["state"]}
        target = root / f"dcp_{i}"
        writer = dcp.FileSystemWriter(str(target), sync_files=True)
        times.setdefault("dcp.save", []).append(
            timed(functools.partial(dcp.save, state, storage_writer=writer))
        )
        target = root / f"dcp_reread_{i}"
        times.setdefault("dcp.save + re-read SHA-256", []).append(
            timed(functools.partial(_save_then_hash, state, target, rank))
        )
        shutil.rmtree(target, ignore_errors=True) if rank == 0 else None
        times.setdefault("memcpy", []).append(timed(functools.partial(_clone_all, state)))
        times.setdefault("torch.save rank 0", []).append(
            timed(lambda: _torch_save(model, opt, root, rank))
        )
        shutil.rmtree(target, ignore_errors=True) if rank == 0 else None
    ckpt = meshrun.checkpoint.list_checkpoints(root / "m")[-1].path
    nbytes = dir_bytes(ckpt)
    run.config.checkpoint.resume = str(ckpt)
    times["meshrun resume"] = [timed(run._parts.checkpointer.resume) for _ in range(args.repeats)]
    times["torch.load rank 0"] = [
        timed(lambda: torch.load(root / "full.pt", weights_only=True) if rank == 0 else None)
        for _ in range(args.repeats)
    ]
    times["disk (fsync'd write)"] = [
        timed(lambda: fsync_write(root / "dd.bin", nbytes=nbytes) if rank == 0 else None)
        for _ in range(args.repeats)
    ]
    if rank == 0:
        report(times, nbytes, nparams, world, args)
    run.close()


def _fwd_bwd(model: nn.Module) -> None:
    model(torch.randn(4, WIDTH)).sum().backward()


def _async_save(run: Any, model: nn.Module) -> tuple[float, float, float]:
    """What an async interval save costs the training thread: the call, then one forward and
    backward (what training does next, while the state is copied in the background), then the
    wait before the optimizer step (``before_update``). Returns (blocked, durable, the forward
    and backward's own time) seconds: the copy shares the CPU with them, so compare the last
    with ``forward+backward`` alone."""
    dist.barrier()
    t0 = time.perf_counter()
    run._parts.checkpointer.save_async()
    blocked = time.perf_counter() - t0
    t1 = time.perf_counter()
    _fwd_bwd(model)
    t2 = time.perf_counter()
    run._parts.checkpointer.before_update()
    blocked += time.perf_counter() - t2
    run._parts.checkpointer.wait()
    dist.barrier()
    return blocked, time.perf_counter() - t0, t2 - t1


def _save_then_hash(state: Any, target: Path, rank: int) -> None:
    """How meshrun hashed before it hashed while writing: save, then re-read its own shards."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(target), sync_files=True))
    on_disk.hash_files(target, [p.name for p in target.glob(f"__{rank}_*.distcp")])


def _clone_all(state: Any) -> list[torch.Tensor]:
    return [t.clone() for t in _tensors(state)]


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    return []


def _torch_save(model: nn.Module, opt: torch.optim.Optimizer, root: Path, rank: int) -> None:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=opts)
    if rank == 0:
        with open(root / "full.pt", "wb") as fh:
            torch.save({"model": msd, "optim": osd}, fh)
            fh.flush()
            os.fsync(fh.fileno())


def report(times: dict[str, list[float]], nbytes: int, nparams: int, world: int, args: Any) -> None:
    gb = nbytes / 1e9
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"\n{nparams / 1e6:.0f}M parameters + AdamW = {gb:.2f} GB on {world} ranks, median of {args.repeats}"
    )
    print(f"{'variant':<24}{'seconds':>10}{'GB/s':>8}")
    for k, s in med.items():
        print(f"{k:<24}{s:>10.2f}{gb / s:>8.2f}")
    ratio = med["disk (fsync'd write)"] / med["meshrun save"]
    print(f"meshrun save throughput / disk fsync'd write: {ratio:.0%} (target >= 80%)")
    ratio = med["disk (fsync'd write)"] / med["dcp.save + re-read SHA-256"]
    print(f"before (dcp.save + re-read SHA-256) / disk fsync'd write: {ratio:.0%}")
    blocked = med["meshrun async: blocked"] / med["meshrun save"]
    print(f"async blocked time / sync save time: {blocked:.0%} (target <= 6%)")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"bytes": nbytes, "params": nparams, "world": world, "seconds": times}, indent=1
            )
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=110e6)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default="/tmp/meshrun-ckpt-bench")
    p.add_argument("--out", default="")
    args = p.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    Path(args.dir).mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(worker, args=(args.nproc, port, args), nprocs=args.nproc)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
