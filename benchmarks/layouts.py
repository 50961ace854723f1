"""Step time, per-rank model-state bytes and peak RSS of each parallel layout (issue 3, item 8).

```
.venv/bin/python benchmarks/layouts.py [--size small|tiny] [--repeats 2] [--steps 8] [--skip 3]
    [--worlds 2,4] [--out results.json]
```

Each layout trains the demo GPT (AdamW, the same global batch on every layout) in its own
spawned world of Gloo processes (``OMP_NUM_THREADS=1``), so its peak RSS is its own. Runs are
interleaved (round 1: every layout once, round 2: again, ...) so a machine that gets busier
hits every layout alike; the table shows the median over rounds of each run's median step time
(the first ``--skip`` steps are warm-up). Model-state bytes are measured from the tensors each
rank actually holds (local shards of DTensors): parameters + gradients + optimizer state, max
over ranks. Peak RSS is ``ru_maxrss`` of each rank, max over ranks (it includes torch itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawned_world import run_world, timed_steps
from torch import Tensor, nn

from meshrun.config import ParallelConfig, check_layout
from meshrun.demo.model import GPT, demo_config
from meshrun.parallel import (
    build_optimizer,
    parallelize,
    parallelize_pipeline,
    pipeline_step,
    set_grad_sync,
)
from meshrun.runtime.mesh import ParallelDims, build_mesh

GLOBAL_BATCH = 8
LAYOUTS: dict[int, dict[str, dict[str, Any]]] = {
    2: {
        "DDP": {"zero": 0},
        "ZeRO-1": {"zero": 1},
        "ZeRO-2": {"zero": 2},
        "ZeRO-3": {"zero": 3},
        "TP 2": {"tp": 2},
        "PP 2 (1F1B)": {"pp": 2, "pp_microbatches": 2},
    },
    4: {
        "DDP": {"zero": 0},
        "ZeRO-1": {"zero": 1},
        "ZeRO-2": {"zero": 2},
        "ZeRO-3": {"zero": 3},
        "FSDP 2 x TP 2": {"zero": 3, "tp": 2},
        "PP 2 x ZeRO-3 2": {"pp": 2, "zero": 3, "pp_microbatches": 2},
        "PP 2 x ZeRO-1 2": {"pp": 2, "zero": 1, "pp_microbatches": 2},
    },
}


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(rank: int, layout: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    cfg = ParallelConfig(**layout)
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    check_layout(cfg, vars(dims))
    mesh = build_mesh(dims, "cpu")
    gpt = demo_config(args.size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model: nn.Module = GPT(gpt)
    pipe = None
    if dims.pp > 1:
        pipe = parallelize_pipeline(model, mesh, cfg, torch.device("cpu"), lm_loss)
        opt = build_optimizer(pipe, torch.optim.AdamW, mesh, cfg, lr=1e-3)  # ZeRO-1 when zero=1
    else:
        model = parallelize(model, mesh, cfg, torch.device("cpu"))
        opt = build_optimizer(model, torch.optim.AdamW, mesh, cfg, lr=1e-3)
    per_rank = GLOBAL_BATCH // dims.dp
    g = torch.Generator().manual_seed(dims.dp_rank(rank))

    def forward_backward() -> None:
        tokens = torch.randint(0, gpt.vocab_size, (per_rank, gpt.seq_len + 1), generator=g)
        if pipe is not None:
            pipeline_step(pipe, tokens[:, :-1], tokens[:, 1:])
        else:
            set_grad_sync(model, True)
            model(tokens[:, :-1], tokens[:, 1:]).backward()

    return timed_steps(forward_backward, opt, args.steps, args.skip)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--out", default="")
    p.add_argument(
        "--mmap-threshold-kib",
        type=int,
        default=0,
        help="job.cpu_mmap_threshold_kib for every layout (0: glibc's default)",
    )
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    worlds = [int(w) for w in args.worlds.split(",")]
    runs: dict[tuple[int, str], list[dict[str, float]]] = {}
    for _ in range(args.repeats):  # interleaved: each round runs every layout once
        for world in worlds:
            for name, layout in LAYOUTS[world].items():
                runs.setdefault((world, name), []).append(run_world(world, train, layout, args))
                print(f"  {world} ranks {name}: {runs[(world, name)][-1]}", flush=True)
    n = sum(x.numel() for x in GPT(demo_config(args.size)).parameters())
    print(f"\ndemo GPT {args.size} ({n / 1e6:.2f}M parameters), AdamW, global batch {GLOBAL_BATCH}")
    print(
        "| ranks | layout | step (s, median) | vs DDP | model state / rank (MiB) | peak RSS / rank (MiB) |"
    )
    print("|---|---|---|---|---|---|")
    table = []
    for (world, name), rs in runs.items():
        row: dict[str, Any] = {
            k: statistics.median(r[k] for r in rs) for k in ("step_s", "bytes", "rss")
        }
        ddp = statistics.median(r["step_s"] for r in runs[(world, "DDP")])
        row |= {"world": world, "layout": name, "vs_ddp": row["step_s"] / ddp}
        table.append(row)
        print(
            f"| {world} | {name} | {row['step_s']:.3f} | {row['vs_ddp']:.2f}x | "
            f"{row['bytes'] / 2**20:.1f} | {row['rss'] / 2**20:.0f} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
