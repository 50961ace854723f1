"""Per-step costs of meshrun's own code, timed inside a real training run: a diagnostic for
``overhead.py``, not part of its result.

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone \
        --nproc-per-node 2 benchmarks/overhead_insitu.py [--size small --steps 50]

The demo loop runs through meshrun with default metrics while the step loop's per-step
functions are wrapped with timers (wall and CPU time of each call). In place, with the
caches cold from the forward, backward and optimizer step, they cost more than the same calls
repeated in a tight loop (``overhead_breakdown.py``). Rank 0 prints the medians per call and
the calls per optimizer step. The wrappers reach into meshrun's internals: a diagnostic, to
be adjusted when those move.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import meshrun
import meshrun.train.loop
from meshrun.demo.corpus import build_demo_datasets
from meshrun.demo.model import GPT, demo_config
from meshrun.monitor.metrics import MetricsLogger

Timings = dict[str, list[tuple[float, float]]]

# (owner, attribute, label): what runs on every optimizer step besides the user's code.
TIMED: list[tuple[Any, str, str]] = [
    (meshrun.train.loop.StepLoop, "_record", "all metrics work (_record)"),
    (meshrun.train.loop.StepLoop, "_global_mean_loss", "  loss all-reduce + .item()"),
    (meshrun.train.loop, "memory_stats", "  memory_stats"),
    (MetricsLogger, "log_step", "  MetricsLogger.log_step"),
    (MetricsLogger, "_write", "    jsonl row"),
    (MetricsLogger, "_on_console", "    console line (rich)"),
    (meshrun.train.loop, "to_device", "to_device (per call, nested)"),
    (meshrun.train.loop, "set_grad_sync", "set_grad_sync"),
]


def wrap(owner: Any, name: str, label: str, timings: Timings) -> None:
    fn: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t, c = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            timings[label].append((time.perf_counter() - t, time.process_time() - c))

    timings[label] = []
    setattr(owner, name, timed)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    args = p.parse_args()
    timings: Timings = {}
    for owner, name, label in TIMED:
        wrap(owner, name, label, timings)
    with tempfile.TemporaryDirectory() as tmp:
        run = meshrun.init(
            argv=[
                f"--job.run_dir={tmp}",
                "--data.micro_batch=4",
                "--metrics.progress=false",
                f"--optim.steps={args.steps}",
            ]
        )
        cfg = demo_config(args.size)
        model = run.parallelize(GPT(cfg))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
        train, _ = build_demo_datasets(cfg.seq_len)
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
            print(f"{'per call, median':<30} {'wall ms':>8} {'cpu ms':>8} {'calls/step':>10}")
            for label, values in timings.items():
                per_step = len(values) / args.steps
                kept = values[int(args.skip * per_step) :]
                wall = statistics.median(v[0] for v in kept) * 1e3
                cpu = statistics.median(v[1] for v in kept) * 1e3
                print(f"{label:<30} {wall:8.3f} {cpu:8.3f} {per_step:10.0f}")
        run.close()


if __name__ == "__main__":
    main()
