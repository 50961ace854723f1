"""Variant B of the overhead benchmark: the same training as ``overhead_plain.py`` through
meshrun's API, as the demo writes it (``meshrun.init``, ``run.parallelize``,
``run.dataloader``, ``run.steps``, ``run.backward``, ``run.optimizer_step``).

Metrics stay at their defaults (a metrics.jsonl row, a console line, the memory figures and
the global-loss all-reduce on every step) except the progress bar, which is off. Started by
``benchmarks/overhead.py`` through torchrun, exactly like the plain variant.
"""

from __future__ import annotations

import torch
from overhead_common import Clock, parse_worker_args, write_result

import meshrun
from meshrun.demo.corpus import build_demo_datasets
from meshrun.demo.model import GPT, demo_config

CLOCK = Clock()


@meshrun.main
def main() -> None:
    args = parse_worker_args()
    CLOCK.mark("imported")
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
    CLOCK.mark("initialized")

    cfg = demo_config(args.size)
    model = run.parallelize(GPT(cfg))
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=run.scaled_lr(),
        betas=(0.9, 0.95),
        weight_decay=run.config.optim.weight_decay,
    )
    run.lr_scheduler(opt)
    CLOCK.mark("model")

    train, _ = build_demo_datasets(cfg.seq_len, limit_bytes=args.corpus_bytes)
    loader = run.dataloader(train)
    CLOCK.mark("data")

    CLOCK.start_steps()
    for batch in run.steps(loader):
        loss = model(batch["input"], batch["target"])
        run.backward(loss)
        if run.optimizer_step(opt):
            CLOCK.end_step()

    if run.is_main:
        write_result(
            args.result,
            "meshrun",
            CLOCK,
            args.skip,
            # The global mean loss of the last step, as meshrun logged it.
            final_loss=run.summary()["loss_last"],
            world_size=run.world_size,
            accum=run.accum,
        )
    run.close()


if __name__ == "__main__":
    main()
