"""Where meshrun's per-step time goes: a diagnostic for ``overhead.py``, not part of its result.

Run it through torchrun like the workers (rank 0 prints):

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone \
        --nproc-per-node 2 benchmarks/overhead_breakdown.py [--size small --steps 20]

Two measurements, both inside one pair of processes so that a busy machine slows both sides
alike:

1. Whole steps, interleaved step by step: a plain ``no_sync`` step, then a step through
   ``run.steps`` / ``run.backward`` / ``run.optimizer_step``, on the same DDP model and
   optimizer; the median paired difference is meshrun's cost per optimizer step. Also: the
   plain step on a second copy wrapped in DDP with torch's defaults (the plain worker's DDP),
   the plain step plus the loss all-reduce meshrun does on a logged step, and meshrun with
   logging off.
2. Each per-step extra on its own, repeated: the memory figures, the loss all-reduce of a
   logged step, one metrics row (jsonl + console line), moving the micro-batches "to the
   device", the grad-sync switch and fetching a global batch from each loader.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import meshrun
from meshrun.demo.corpus import build_demo_datasets
from meshrun.demo.model import GPT, demo_config
from meshrun.monitor import memory_stats
from meshrun.parallel import set_grad_sync
from meshrun.train.loop import to_device


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn``."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def plain_step(model: Any, opt: Any, batches: Iterator[Any], accum: int) -> None:
    for micro in range(accum):
        batch = next(batches)
        with nullcontext() if micro == accum - 1 else model.no_sync():
            (model(batch["input"], batch["target"]) / accum).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def meshrun_step(run: meshrun.Run, model: Any, opt: Any, steps: Iterator[Any]) -> None:
    for _ in range(run.accum):
        batch = next(steps)
        run.backward(model(batch["input"], batch["target"]))
        run.optimizer_step(opt)


def set_log_every(run: meshrun.Run, every: int) -> None:
    """metrics.log_every for the rest of the run: the loop's figures are frozen, so its loop
    gets a copy of the machinery with the other figure (the same parts)."""
    run._loop.parts = dataclasses.replace(run._parts, log_every=every)
    run._parts.metrics.log_every = every


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--steps", type=int, default=20, help="steps of each kind, interleaved")
    p.add_argument("--reps", type=int, default=200, help="repetitions of each extra")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"--job.run_dir={tmp}", "--data.micro_batch=4", "--metrics.progress=false"]
        run = meshrun.init(argv=[*overrides, f"--optim.steps={10 * args.steps}"])
        cfg = demo_config(args.size)
        model = run.parallelize(GPT(cfg))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
        train, _ = build_demo_datasets(cfg.seq_len)
        mesh_loader = run.dataloader(train)
        steps = iter(run.steps(mesh_loader))
        plain_batches = iter(DataLoader(train, batch_size=4, sampler=range(len(train))))
        # The plain worker's DDP: torch's defaults (meshrun sets gradient_as_bucket_view).
        torch.manual_seed(0)
        default_ddp = DDP(GPT(cfg))
        default_opt = torch.optim.AdamW(default_ddp.parameters(), lr=1e-3, betas=(0.9, 0.95))

        group = run.mesh.get_group("dp") if run.mesh is not None else None

        def plain_synced() -> None:  # plus the one scalar all-reduce a logged step does
            plain_step(model, opt, plain_batches, run.accum)
            dist.all_reduce(torch.tensor(2.5), group=group)

        def meshrun_logging(every: int) -> Callable[[], None]:
            def step() -> None:
                set_log_every(run, every)
                meshrun_step(run, model, opt, steps)

            return step

        kinds: dict[str, Callable[[], None]] = {
            "plain": lambda: plain_step(model, opt, plain_batches, run.accum),
            "plain, DDP defaults": lambda: plain_step(
                default_ddp, default_opt, plain_batches, run.accum
            ),
            "plain + loss all-reduce": plain_synced,
            "meshrun (log every step)": meshrun_logging(1),
            "meshrun (no logging)": meshrun_logging(10**9),
        }
        wall: dict[str, list[float]] = {k: [] for k in kinds}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        for i in range(args.steps + 2):
            for name, fn in kinds.items():
                t, c = time.perf_counter(), time.process_time()
                fn()
                if i >= 2:  # warm-up
                    wall[name].append(time.perf_counter() - t)
                    cpu[name].append(time.process_time() - c)

        set_log_every(run, 1)  # the default: every step is logged
        loss = torch.tensor(2.5)
        batch = next(iter(mesh_loader))
        extras = {
            "memory_stats (per logged step)": lambda: memory_stats(run.device),
            "loss all-reduce (per logged step)": lambda: dist.all_reduce(loss.clone(), group=group),
            "metrics row: jsonl + console (rank 0)": lambda: run._parts.metrics.log_step(
                1, loss=2.5, lr=1e-3, step_time_s=0.5, samples=32, tokens=4096, extra={}
            ),
            "to_device x accum": lambda: [to_device(batch, run.device) for _ in range(run.accum)],
            "set_grad_sync x accum": lambda: [set_grad_sync(model, True) for _ in range(run.accum)],
            "meshrun loader, one global batch": lambda: [next(iter_mesh) for _ in range(run.accum)],
            "plain loader, one global batch": lambda: [
                next(plain_batches) for _ in range(run.accum)
            ],
        }
        iter_mesh = iter(mesh_loader)
        costs = {k: timed(fn, args.reps) for k, fn in extras.items()}
        if run.is_main:
            print(f"\n== whole steps, {args.steps} of each kind, interleaved ({args.size} model)")
            print("   medians; 'vs plain' is the median of the paired differences with the plain")
            print("   step run just before, which cancels the machine's slower drifts")
            print(f"{'kind':<26} {'wall ms':>9} {'vs plain':>9} {'cpu ms':>9} {'vs plain':>9}")
            for k in kinds:
                cols = []
                for series in (wall, cpu):
                    diffs = [b - a for a, b in zip(series["plain"], series[k], strict=True)]
                    cols.append(f"{statistics.median(series[k]) * 1e3:9.2f}")
                    cols.append(f"{statistics.median(diffs) * 1e3:+9.2f}")
                print(f"{k:<26} " + " ".join(cols))
            print(f"== per-step extras, median of {args.reps} calls")
            for k, v in costs.items():
                print(f"{k:<40} {v * 1e3:8.3f} ms")
        run.close()


if __name__ == "__main__":
    main()
