"""The meshrun demo: a byte-level GPT learns to write Python from the standard library's source.

Nothing is downloaded: the corpus is the ``.py`` files of the local Python installation. The
loop is a plain PyTorch loop with meshrun's few lines; read it top to bottom. Run it with
``meshrun demo`` or, like any script, ``meshrun launch --nproc-per-node 2 -m meshrun.demo``.

Flags: ``--steps N``, ``--run-dir DIR``, ``--size tiny|small``, plus any ``--section.key=value``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import meshrun
from meshrun.data import TokenDataset
from meshrun.demo.corpus import decode, demo_tokens_dir, prepare_demo_tokens
from meshrun.demo.model import GPT, GPTConfig, demo_config
from meshrun.plan.cost import Model, model_flops_per_iteration

DEFAULT_CONFIG = Path(__file__).with_name("demo.toml")


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="meshrun.demo", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help="optimizer steps (= --optim.steps)")
    p.add_argument("--run-dir", help="run directory (= --job.run_dir)")
    p.add_argument("--size", default="small", choices=["tiny", "small"], help="model size")
    p.add_argument("--corpus-bytes", type=int, default=4_000_000, help="bytes of stdlib source")
    args, rest = p.parse_known_args(argv)
    # The demo's own flags are spelled-out config overrides.
    if args.steps is not None:
        rest.append(f"--optim.steps={args.steps}")
    if args.run_dir is not None:
        rest.append(f"--job.run_dir={args.run_dir}")
    return args, rest


def plan_flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token of this shape by the planner's formula (docs/plan.md)."""
    shape = Model(
        layers=cfg.n_layer,
        hidden=cfg.d_model,
        heads=cfg.n_head,
        vocab=cfg.vocab_size,
        seq=cfg.seq_len,
        ffn=cfg.ffn_mult * cfg.d_model,
    )
    return model_flops_per_iteration(shape, batch=1) / cfg.seq_len


@torch.no_grad()
def whole(t: torch.Tensor) -> torch.Tensor:
    """Loss parallel keeps logits (and so the loss) as DTensors sharded over the vocabulary:
    the whole tensor where the demo reads it (a collective: every rank calls it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def evaluate(run: meshrun.Run, model: nn.Module, val: TokenDataset) -> float:
    """Exact mean loss over the validation windows: each window once across ranks."""
    net = model.module if isinstance(model, DDP) else model  # no DDP sync in eval
    net.eval()
    totals = torch.zeros(2, device=run.device)  # [sum of losses, count]
    for batch in run.dataloader(val, mode="eval"):
        x, y = batch["input"].to(run.device), batch["target"].to(run.device)
        with run.loss_parallel():  # parallel.loss_parallel: cross-entropy on sharded logits
            totals[0] += whole(net(x, y)) * x.shape[0]
        totals[1] += x.shape[0]
    net.train()
    run.all_reduce_sum(totals)  # once, at the end: ranks may hold one window more or less
    return float(totals[0] / totals[1])


def demo_datasets(
    run: meshrun.Run, seq_len: int, limit_bytes: int
) -> tuple[TokenDataset, TokenDataset]:
    """Train and validation samples of the stdlib corpus, through meshrun's data pipeline:
    rank 0 prepares the token shards once under ``RUN_DIR/corpus`` (reused by later runs and
    resumes), the others wait, then every rank maps them. Validation is the tail."""
    cache = run.run_dir / "corpus"
    if run.is_main:
        prepare_demo_tokens(cache, limit_bytes, log=run.log.info)
    if dist.is_initialized():
        dist.barrier()  # the shards exist before any rank opens them
    return TokenDataset(demo_tokens_dir(cache, limit_bytes), seq_len).split(0.02)


@torch.no_grad()
def sample(model: nn.Module, prompt: bytes, n: int, seq_len: int, device: torch.device) -> str:
    """A seeded top-k continuation of ``prompt``, to show what the model has learned."""
    net = model.module if isinstance(model, DDP) else model
    net.eval()
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
    for _ in range(n):
        logits = whole(net(ids[:, -seq_len:]))[:, -1] / 0.8  # temperature < 1: fewer odd bytes
        top = torch.topk(logits, k=10)
        choice = torch.multinomial(top.values.softmax(-1), 1, generator=gen)
        ids = torch.cat([ids, top.indices.gather(-1, choice)], dim=1)
    return decode(ids[0])


@meshrun.main
def main(argv: Sequence[str] | None = None) -> None:
    args, overrides = parse_args(argv)
    # Under `meshrun launch` the resolved config arrives as MESHRUN_CONFIG; alone, demo.toml.
    config = None if os.environ.get(meshrun.config.CONFIG_ENV) else DEFAULT_CONFIG
    run = meshrun.init(config, argv=overrides)
    cfg = run.config

    train, val = demo_datasets(run, demo_config(args.size).seq_len, args.corpus_bytes)
    # The vocabulary comes from the data: 256 bytes + the end-of-document id = 257.
    model_cfg = replace(demo_config(args.size), vocab_size=train.manifest.vocab_size)
    model = run.parallelize(GPT(model_cfg))
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=run.scaled_lr(),
        betas=(0.9, 0.95),
        weight_decay=cfg.optim.weight_decay,
    )
    run.lr_scheduler(opt)
    run.set_flops_per_token(plan_flops_per_token(model_cfg))  # MFU in the metrics
    if run.is_main:
        run.log.info(
            "model: %.2fM parameters | corpus: %d train / %d val samples of %d tokens",
            sum(p.numel() for p in model.parameters()) / 1e6,
            len(train),
            len(val),
            model_cfg.seq_len,
        )

    loader = run.dataloader(train)
    run.resume(model, opt, loader)  # newest valid checkpoint under [checkpoint] dir, if any
    for batch in run.steps(loader):
        with run.loss_parallel():  # a no-op unless parallel.loss_parallel = true
            loss = model(batch["input"], batch["target"])
        run.backward(loss)
        run.optimizer_step(opt)

    val_loss = evaluate(run, model, val)
    path = run.save_checkpoint()
    # Every rank samples: a sharded model (FSDP, tensor parallel) needs all ranks in each forward.
    text = sample(model, b"def ", 160, model_cfg.seq_len, run.device)
    if run.is_main:
        run.log.info(
            "validation loss %.4f (exact, %d samples) | checkpoint %s", val_loss, len(val), path
        )
        run.log.info(
            "sample after %d steps (byte-level: it learns spelling first; --steps 1000 writes more "
            "Python-like text):\n  %s",
            run.step,
            text.replace("\n", "\n  "),
        )
    run.close()


if __name__ == "__main__":
    main()
