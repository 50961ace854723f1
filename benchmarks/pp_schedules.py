"""Step time of each pipeline schedule on CPU against the planner's bubble term (issue 37, 4).

```
PYTHONPATH=src .venv/bin/python benchmarks/pp_schedules.py [--steps 15] [--skip 3]
    [--microbatches 4] [--batch 8] [--layers 4] [--out results.json]
```

The demo GPT (small: d_model 256, seq 128; ``--layers`` blocks) trains with SGD on 2 Gloo
ranks, pp = 2, under each ``parallel.pp_schedule`` (2 stages per rank for interleaved, zb1p,
zbv and dualpipev), and on rank 0 alone with the whole model and batch ("one process"). All
of them live in one world and step in turn (round 1: one step of each, round 2: ...), so load
from elsewhere on the machine, which moves over seconds, hits every schedule alike; a step is
timed between barriers (the slowest rank's), the first ``--skip`` rounds are warm-up, figures
are medians over rounds (the ratio to 1F1B: the median of the per-round ratios).

Two comparisons per schedule:

- against one process: a pipeline of p ranks without a bubble would take 1/p of one process's
  step, so ``step x p / one_process - 1`` is the measured idle fraction (bubble, plus the
  sends and the schedule's own overhead), beside the planner's ``bubble_fraction``;
- against 1F1B: the measured ratio beside the planner's (1 + bubble) / (1 + bubble of 1F1B).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor

from meshrun.config import ParallelConfig, check_layout
from meshrun.demo.model import GPT, demo_config
from meshrun.parallel import parallelize_pipeline, pipeline_step
from meshrun.plan.bubble import bubble_fraction
from meshrun.runtime.mesh import ParallelDims, build_mesh
from meshrun.runtime.ports import free_port

PP = 2
CPU = torch.device("cpu")
SCHEDULES = {  # name -> stages per rank
    "1f1b": 1,
    "gpipe": 1,
    "interleaved": 2,
    "zb1p": 2,
    "zbv": 2,
    "dualpipev": 2,
}


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def lm_batch(g: torch.Generator, batch: int, vocab: int, seq: int) -> Tensor:
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def timed(step: Callable[[], None]) -> float:
    """One step's seconds, between two barriers: the slowest rank's."""
    dist.barrier()
    t0 = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - t0


def train(rank: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Every schedule's pipeline (and, on rank 0, the whole model) in this one world, stepped
    in turn: step 1 of each, step 2 of each, ... so the machine's load moves all alike."""
    gpt = dataclasses.replace(demo_config("small"), n_layer=args.layers)

    def model() -> GPT:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return GPT(gpt)

    g = torch.Generator().manual_seed(0)
    whole = model()
    whole_opt = torch.optim.SGD(whole.parameters(), lr=1e-3)

    def one_process() -> None:  # rank 0 alone; rank 1 waits at the barrier
        if rank == 0:
            tokens = lm_batch(g, args.batch, gpt.vocab_size, gpt.seq_len)
            lm_loss(whole(tokens[:, :-1]), tokens[:, 1:]).backward()
            whole_opt.step()
            whole_opt.zero_grad(set_to_none=True)

    steps: dict[str, Callable[[], None]] = {"one process": one_process}
    for name in SCHEDULES:
        cfg = ParallelConfig(pp=PP, pp_microbatches=args.microbatches, pp_schedule=name)
        dims = ParallelDims.from_config(cfg, dist.get_world_size())
        check_layout(cfg, vars(dims))
        pipe = parallelize_pipeline(model(), build_mesh(dims, "cpu"), cfg, CPU, lm_loss)
        steps[name] = _pipe_step(pipe, g, args, gpt.vocab_size, gpt.seq_len)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            times[name].append(timed(step))
    return {k: v[args.skip :] for k, v in times.items()}


def _pipe_step(
    pipe: Any, g: torch.Generator, args: argparse.Namespace, vocab: int, seq: int
) -> Callable[[], None]:
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def step() -> None:
        tokens = lm_batch(g, args.batch, vocab, seq)
        pipeline_step(pipe, tokens[:, :-1], tokens[:, 1:])
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(PP), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(PP))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = train(rank, args)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # a Gloo worker can abort in interpreter teardown (see tests/_dist.py)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=15, help="rounds: one step of each schedule")
    p.add_argument("--skip", type=int, default=3, help="warm-up rounds left out")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="samples per step (one micro-batch)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default="")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(free_port(), args, f"{tmp}/r"), nprocs=PP)
        times = json.loads(Path(f"{tmp}/r").read_text())
    one = statistics.median(times.pop("one process"))
    m = args.microbatches
    b0 = bubble_fraction("1f1b", PP, 1, m)
    print(
        f"\ndemo GPT small, {args.layers} blocks, batch {args.batch} in {m} chunks, pp = {PP}, "
        f"{len(times['1f1b'])} rounds; one process {one:.4f} s/step (median)"
    )
    print("| schedule | step (s, median) | idle measured | bubble (planner) | vs 1F1B | planner |")
    print("|---|---|---|---|---|---|")
    table = []
    for name, v in SCHEDULES.items():
        step = statistics.median(times[name])
        bubble = bubble_fraction(name, PP, v, m)
        row = {
            "schedule": name,
            "step_s": step,
            "idle": step * PP / one - 1,
            "bubble": bubble,
            "vs_1f1b": statistics.median(
                a / b for a, b in zip(times[name], times["1f1b"], strict=True)
            ),
            "planner_vs_1f1b": (1 + bubble) / (1 + b0),
            "steps": times[name],
        }
        table.append(row)
        print(
            f"| {name} | {step:.4f} | {row['idle']:.3f} | {bubble:.3f} | "
            f"{row['vs_1f1b']:.3f} | {row['planner_vs_1f1b']:.3f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"one_process_s": one, "rows": table}, indent=2))


if __name__ == "__main__":
    main()
