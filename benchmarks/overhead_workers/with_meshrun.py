"""The meshrun side of ``benchmarks/overhead.py``: a script as users write it with meshrun.

``with_meshrun.py --result ... --steps ...`` (``--mode step``, variant B): the same training as
``plain.py`` through meshrun's API, as the demo writes it (``meshrun.init``,
``run.parallelize``, ``run.dataloader``, ``run.steps``, ``run.backward``,
``run.optimizer_step``). Metrics stay at their defaults (a metrics.jsonl row, a console line,
the memory figures and the global loss on every step) except the progress bar, which is off.
Started through torchrun, exactly like the plain variant.

``with_meshrun.py first-step [--section.key=value ...]`` (``--mode secret``, started by
``meshrun launch`` with the checkout under test first on ``PYTHONPATH``): ``meshrun.init()``,
one step of a linear model, and rank 0 writes the wall-clock time that step ended to the file
``FIRST_STEP`` names.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from common import Clock, parse_worker_args, write_result

import meshrun
from meshrun.demo.corpus import build_demo_datasets
from meshrun.demo.model import GPT, demo_config


@meshrun.main
def train() -> None:
    clock = Clock()
    args = parse_worker_args()
    clock.mark("imported")
    run = meshrun.init(
        argv=[
            f"--job.run_dir={args.run_dir}",
            f"--job.seed={args.seed}",
            f"--data.global_batch={args.global_batch}",
            f"--data.micro_batch={args.micro_batch}",
            f"--optim.steps={args.steps}",
            f"--optim.lr={args.lr}",
            f"--optim.warmup_steps={args.warmup_steps}",
            "--optim.decay=cosine",
            f"--optim.min_lr_ratio={args.min_lr_ratio}",
            f"--optim.weight_decay={args.weight_decay}",
            "--metrics.progress=false",
        ]
    )
    clock.mark("initialized")

    cfg = demo_config(args.size)
    model = run.parallelize(GPT(cfg))
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=run.scaled_lr(),
        betas=(0.9, 0.95),
        weight_decay=run.config.optim.weight_decay,
    )
    run.lr_scheduler(opt)
    clock.mark("model")

    train, _ = build_demo_datasets(cfg.seq_len, limit_bytes=args.corpus_bytes)
    loader = run.dataloader(train)
    clock.mark("data")

    clock.start_steps()
    for batch in run.steps(loader):
        loss = model(batch["input"], batch["target"])
        run.backward(loss)
        if run.optimizer_step(opt):
            clock.end_step()

    if run.is_main:
        write_result(
            args.result,
            "meshrun",
            clock,
            args.skip,
            # The global mean loss of the last step, as meshrun logged it.
            final_loss=run.summary()["loss_last"],
            world_size=run.world_size,
            accum=run.accum,
        )
    run.close()


@meshrun.main
def first_step() -> None:
    run = meshrun.init(argv=sys.argv[2:])
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = run.parallelize(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for inputs, targets in run.steps(run.dataloader(data)):
        run.backward(torch.nn.functional.mse_loss(model(inputs), targets))
        if run.optimizer_step(opt) and run.rank == 0:
            Path(os.environ["FIRST_STEP"]).write_text(repr(time.time()))


if __name__ == "__main__":
    if sys.argv[1:2] == ["first-step"]:
        first_step()
    else:
        train()
