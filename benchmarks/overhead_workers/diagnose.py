"""Where meshrun's per-step time goes: the diagnostics of ``benchmarks/overhead.py``, not part
of its result. ``overhead.py --mode breakdown|insitu`` starts this script through torchrun
(``diagnose.py breakdown|insitu --size S --steps N ...``); rank 0 prints.

``breakdown``: two measurements, both inside one pair of processes so that a busy machine
slows both sides alike.

1. Whole steps, interleaved step by step: a plain ``no_sync`` step, then a step through
   ``run.steps`` / ``run.backward`` / ``run.optimizer_step``, on the same DDP model and
   optimizer; the median paired difference is meshrun's cost per optimizer step. Also: the
   plain step on a second copy wrapped in DDP with torch's defaults (the plain worker's DDP),
   the plain step plus the scalar all-reduce meshrun does on every step, and meshrun with
   logging off.
2. Each per-step extra on its own, repeated: the memory figures, a scalar all-reduce, one
   metrics row (jsonl + console line), moving the micro-batches "to the device", the
   grad-sync switch and fetching a global batch from each loader.

``insitu``: the demo loop runs through meshrun with default metrics while the step loop's
per-step functions are wrapped with timers (wall and CPU time of each call). In place, with
the caches cold from the forward, backward and optimizer step, they cost more than the same
calls repeated in a tight loop (``breakdown``). Rank 0 prints the medians per call and the
calls per optimizer step. The wrappers reach into meshrun's internals: a diagnostic, to be
adjusted when those move (a name that is gone fails at the start, naming it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import meshrun
import meshrun.train.loop
from meshrun.demo.corpus import build_demo_datasets
from meshrun.demo.model import GPT, demo_config
from meshrun.monitor import memory_stats
from meshrun.monitor.metrics import MetricsLogger
from meshrun.parallel import set_grad_sync
from meshrun.runtime.agreement import StepAgreement
from meshrun.train.loop import to_device

Timings = dict[str, list[tuple[float, float]]]
Step = Callable[[], None]

# insitu: (owner, attribute, label), what runs on every optimizer step besides the user's code.
TIMED: list[tuple[Any, str, str]] = [
    (StepAgreement, "exchange", "per-step agreement (all-reduce)"),
    (meshrun.train.loop.StepLoop, "_record", "all metrics work (_record)"),
    (meshrun.train.loop, "memory_stats", "  memory_stats"),
    (MetricsLogger, "log_step", "  MetricsLogger.log_step"),
    (MetricsLogger, "_write", "    jsonl row"),
    (MetricsLogger, "_on_console", "    console line"),
    (meshrun.train.loop, "to_device", "to_device (per call, nested)"),
    (meshrun.train.loop, "set_grad_sync", "set_grad_sync"),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["breakdown", "insitu"])
    p.add_argument("--size", required=True, choices=["tiny", "small"])
    p.add_argument("--steps", type=int, required=True, help="steps (breakdown: of each kind)")
    p.add_argument("--skip", type=int, required=True, help="warm-up steps left out")
    p.add_argument("--reps", type=int, required=True, help="breakdown: repetitions per extra")
    p.add_argument("--run-dir", required=True, help="meshrun's run directory, one for all ranks")
    return p.parse_args()


def start(run_dir: str, steps: int, size: str) -> tuple[meshrun.Run, Any, Any, Any]:
    """The demo GPT through meshrun, as both diagnostics train it: run, model, AdamW, data."""
    run = meshrun.init(
        argv=[
            f"--job.run_dir={run_dir}",
            "--data.micro_batch=4",
            "--metrics.progress=false",
            f"--optim.steps={steps}",
        ]
    )
    cfg = demo_config(size)
    model = run.parallelize(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    train, _ = build_demo_datasets(cfg.seq_len)
    return run, model, opt, train


# --- breakdown ---------------------------------------------------------------------------


def set_log_every(run: meshrun.Run, every: int) -> None:
    """metrics.log_every for the rest of the run: the loop's figures are frozen, so its loop
    gets a copy of the machinery with the other figure (the same parts)."""
    run._loop.parts = dataclasses.replace(run._parts, log_every=every)
    run._parts.metrics.log_every = every


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn``."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def repeat(n: int, fn: Callable[[], object]) -> None:
    for _ in range(n):
        fn()


def plain_step(model: Any, opt: Any, batches: Iterator[Any], accum: int) -> None:
    for micro in range(accum):
        batch = next(batches)
        with nullcontext() if micro == accum - 1 else model.no_sync():
            (model(batch["input"], batch["target"]) / accum).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def step_kinds(
    run: meshrun.Run, model: Any, opt: Any, loader: Any, plain_batches: Iterator[Any], size: str
) -> dict[str, Step]:
    """The whole-step variants, each one optimizer step when called."""
    steps = iter(run.steps(loader))
    # The plain worker's DDP: torch's defaults (meshrun sets gradient_as_bucket_view).
    torch.manual_seed(0)
    default_ddp = DDP(GPT(demo_config(size)))
    default_opt = torch.optim.AdamW(default_ddp.parameters(), lr=1e-3, betas=(0.9, 0.95))
    group = run.mesh.get_group("dp") if run.mesh is not None else None

    def plain_synced() -> None:  # plus one scalar all-reduce, as meshrun's per-step agreement
        plain_step(model, opt, plain_batches, run.accum)
        dist.all_reduce(torch.tensor(2.5), group=group)

    def meshrun_logging(every: int) -> Step:
        def step() -> None:
            set_log_every(run, every)
            for _ in range(run.accum):
                batch = next(steps)
                run.backward(model(batch["input"], batch["target"]))
                run.optimizer_step(opt)

        return step

    return {
        "plain": lambda: plain_step(model, opt, plain_batches, run.accum),
        "plain, DDP defaults": lambda: plain_step(
            default_ddp, default_opt, plain_batches, run.accum
        ),
        "plain + loss all-reduce": plain_synced,
        "meshrun (log every step)": meshrun_logging(1),
        "meshrun (no logging)": meshrun_logging(10**9),
    }


def extras(
    run: meshrun.Run, model: Any, loader: Any, plain_batches: Iterator[Any]
) -> dict[str, Callable[[], object]]:
    """Each per-step extra alone, at the default of every step logged."""
    set_log_every(run, 1)
    group = run.mesh.get_group("dp") if run.mesh is not None else None
    loss = torch.tensor(2.5)
    batch = next(iter(loader))
    iter_mesh = iter(loader)
    return {
        "memory_stats (per logged step)": lambda: memory_stats(run.device),
        "loss all-reduce (per logged step)": lambda: dist.all_reduce(loss.clone(), group=group),
        "metrics row: jsonl + console (rank 0)": lambda: run._parts.metrics.log_step(
            1, loss=2.5, lr=1e-3, step_time_s=0.5, samples=32, tokens=4096, extra={}
        ),
        "to_device x accum": lambda: repeat(run.accum, lambda: to_device(batch, run.device)),
        "set_grad_sync x accum": lambda: repeat(run.accum, lambda: set_grad_sync(model, True)),
        "meshrun loader, one global batch": lambda: repeat(run.accum, lambda: next(iter_mesh)),
        "plain loader, one global batch": lambda: repeat(run.accum, lambda: next(plain_batches)),
    }


def breakdown(args: argparse.Namespace, run_dir: str) -> None:
    run, model, opt, train = start(run_dir, 10 * args.steps, args.size)
    loader = run.dataloader(train)
    plain_batches = iter(DataLoader(train, batch_size=4, sampler=range(len(train))))
    kinds = step_kinds(run, model, opt, loader, plain_batches, args.size)
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(args.steps + args.skip):
        for name, fn in kinds.items():
            t, c = time.perf_counter(), time.process_time()
            fn()
            if i >= args.skip:
                wall[name].append(time.perf_counter() - t)
                cpu[name].append(time.process_time() - c)
    costs = {k: timed(fn, args.reps) for k, fn in extras(run, model, loader, plain_batches).items()}
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


# --- insitu ------------------------------------------------------------------------------


def wrap(owner: Any, name: str, label: str, timings: Timings) -> None:
    fn: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(fn)
    def timed_call(*args: Any, **kwargs: Any) -> Any:
        t, c = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            timings[label].append((time.perf_counter() - t, time.process_time() - c))

    timings[label] = []
    setattr(owner, name, timed_call)


def insitu(args: argparse.Namespace, run_dir: str) -> None:
    timings: Timings = {}
    for owner, name, label in TIMED:
        wrap(owner, name, label, timings)
    run, model, opt, train = start(run_dir, args.steps, args.size)
    step_times, last = [], time.perf_counter()
    for batch in run.steps(run.dataloader(train)):
        run.backward(model(batch["input"], batch["target"]))
        if run.optimizer_step(opt):
            now = time.perf_counter()
            step_times.append(now - last)
            last = now
    if run.is_main:
        step = statistics.median(step_times[args.skip :])
        print(f"\n== {args.size} model: median step {step * 1e3:.2f} ms, rank 0")
        print(f"{'per call, median':<32} {'wall ms':>8} {'cpu ms':>8} {'calls/step':>10}")
        for label, values in timings.items():
            per_step = len(values) / args.steps
            kept = values[int(args.skip * per_step) :]
            if not kept:
                print(f"{label:<32} not called")
                continue
            wall = statistics.median(v[0] for v in kept) * 1e3
            cpu = statistics.median(v[1] for v in kept) * 1e3
            print(f"{label:<32} {wall:8.3f} {cpu:8.3f} {per_step:10.0f}")
    run.close()


def main() -> None:
    args = parse_args()
    (breakdown if args.what == "breakdown" else insitu)(args, args.run_dir)


if __name__ == "__main__":
    main()
