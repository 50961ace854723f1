"""The meshrun demo: a byte-level GPT learns to write Python from the standard library's source.

Nothing is downloaded: the corpus is the ``.py`` files of the local Python installation. The
loop is a plain PyTorch loop with meshrun's few lines; read it top to bottom. Run it with
``meshrun demo`` or, like any script, ``meshrun launch --nproc-per-node 2 -m meshrun.demo``.
It runs under every layout of docs/parallel.md by overrides (``--parallel.zero 1``,
``--parallel.pp 2``, ``--parallel.tp 2`` ...): one loop, in which pipeline parallelism changes
two things, both marked: the model is built with ``run.pipeline`` and its schedule runs each
micro-batch's forward and backward (``run.pipeline_step``).

What the run proves is printed at the end: the exact validation loss before and after
training, against the loss of a uniform guess over the 257 ids (ln 257 = 5.55 nats: a model
that has learned nothing), and the throughput.

Flags: ``--steps N``, ``--run-dir DIR``, ``--size tiny|small``, plus any ``--section.key=value``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset

import meshrun
from meshrun.config import split_overrides
from meshrun.data import TokenDataset
from meshrun.demo.corpus import demo_tokens_dir, prepare_demo_tokens
from meshrun.demo.model import GPT, GPTConfig, demo_config
from meshrun.demo.steps import steps_overrides
from meshrun.parallel.cp import cp_group, shard_sequence
from meshrun.parallel.pp.pipeline import Pipeline
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
        keys = {k for k, _ in split_overrides(rest)[0]}
        rest.extend(f"--{k}={v}" for k, v in steps_overrides(args.steps, keys))
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


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Next-byte cross-entropy, as ``GPT.forward`` computes it; the pipeline's last stage calls
    it on each chunk's logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def whole(t: Tensor) -> Tensor:
    """Loss parallel keeps logits (and so the loss) as DTensors sharded over the vocabulary:
    the whole tensor where the demo reads it (a collective: every rank calls it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def demo_datasets(
    run: meshrun.Run, seq_len: int, limit_bytes: int
) -> tuple[TokenDataset, Subset[dict[str, Tensor]]]:
    """Train and validation samples of the stdlib corpus, through meshrun's data pipeline:
    rank 0 prepares the token shards once under ``RUN_DIR/corpus`` (reused by later runs and
    resumes), the others wait, then every rank maps them. Validation is the tail."""
    cache = run.run_dir / "corpus"
    if run.is_main:
        prepare_demo_tokens(cache, limit_bytes, log=run.log.info)
    if dist.is_initialized():
        dist.barrier()  # the shards exist before any rank opens them
    train, val = TokenDataset(demo_tokens_dir(cache, limit_bytes), seq_len).split(0.02)
    # Validation keeps a multiple of the global batch: every data-parallel rank then gets the
    # same number of whole micro-batches, which sharded layouts need (each forward is a
    # collective) and pipelines too (the schedule's chunks have one shape), and the loss is
    # over the same windows on every layout and world size, so runs compare exactly.
    g = run.config.data.global_batch
    return train, Subset(val, range(len(val) // g * g))


def validate(
    run: meshrun.Run, model: nn.Module | Pipeline, val: Subset[dict[str, Tensor]]
) -> tuple[int, float]:
    """(step, exact validation loss), also a line of metrics.jsonl (``"event": "eval"``)."""
    with run.phase("eval"):  # the hang watchdog's longer limit for a pass outside the steps
        loss = evaluate(run, model, val)
    run.log_event("eval", at_step=run.step, val_loss=loss, windows=len(val))
    return run.step, loss


@torch.no_grad()  # evaluation builds no autograd graph
def evaluate(
    run: meshrun.Run, model: nn.Module | Pipeline, val: Subset[dict[str, Tensor]]
) -> float:
    """Exact mean loss over the validation windows: each window once across ranks."""
    totals = torch.zeros(2, device=run.device)  # [sum of losses, count]
    set_training(model, False)
    cp = cp_group(run.mesh)  # parallel.cp > 1: this rank's slice of each sequence, as run.steps
    for batch in run.dataloader(val, mode="eval"):
        x, y = batch["input"].to(run.device), batch["target"].to(run.device)
        if cp is not None:
            x, y = shard_sequence((x, y), cp)
        loss = forward_loss(run, model, x, y)
        if loss is not None:  # under pp only the last stage's ranks have it
            totals[0] += loss * x.shape[0]
            totals[1] += x.shape[0]
    set_training(model, True)
    # Over every rank, once at the end: data-parallel ranks hold different windows, the
    # pipeline's other stages zeros, tp ranks equal sums (the ratio cancels them), and cp
    # ranks their slices' means (the same number of targets each: their mean is the window's).
    if dist.is_initialized():
        dist.all_reduce(totals)
    return float(totals[0] / totals[1])


def forward_loss(
    run: meshrun.Run, model: nn.Module | Pipeline, x: Tensor, y: Tensor
) -> Tensor | None:
    """The mean loss of one batch from a forward pass alone; None on pipeline stages that
    do not hold the head."""
    if not isinstance(model, Pipeline):
        net = model.module if isinstance(model, DDP) else model  # no DDP sync in eval
        with run.loss_parallel():  # parallel.loss_parallel: cross-entropy on sharded logits
            return whole(net(x, y))
    # The stages live on different ranks, so only the schedule can run them: its eval() runs
    # the chunks forward without a backward (torch.distributed.pipelining). It takes the
    # targets because it computes its own chunk losses (scaled for the training step); the
    # demo recomputes the loss from the last stage's merged logits instead.
    first, last = model.is_first, model.is_last
    with run.loss_parallel() if model.loss_parallel else nullcontext():
        logits = model.schedule.eval(*([x] if first else []), target=y if last else None)
        return whole(lm_loss(logits, y)) if last else None


def set_training(model: nn.Module | Pipeline, mode: bool) -> None:
    for module in model.modules if isinstance(model, Pipeline) else [model]:
        module.train(mode)


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
    gpt = GPT(model_cfg)
    n_params = gpt.num_params()
    # The layout comes from [parallel]. A pipelined model (parallel.pp > 1) is split into
    # stages on different ranks, so nobody calls it: its schedule runs forward and backward,
    # and calls lm_loss on the last stage.
    model = run.pipeline(gpt, lm_loss) if cfg.parallel.pp > 1 else run.parallelize(gpt)
    # run.optimizer, not torch.optim.AdamW(...): under parallel.zero = 1 its state is sharded
    # over the data-parallel ranks (a ZeroRedundancyOptimizer); otherwise it is the plain one.
    opt = run.optimizer(
        model,
        torch.optim.AdamW,
        lr=run.scaled_lr(),
        betas=(0.9, 0.95),
        weight_decay=cfg.optim.weight_decay,
    )
    run.lr_scheduler(opt)
    run.set_flops_per_token(plan_flops_per_token(model_cfg))  # MFU in the metrics
    if run.is_main:
        run.log.info("model: %.2fM parameters | corpus: %s", n_params / 1e6, sizes(train, val))

    loader = run.dataloader(train)
    run.resume(model, opt, loader)  # newest valid checkpoint under [checkpoint] dir, if any
    start = validate(run, model, val)  # the baseline: what the steps improve on
    for batch in run.steps(loader):
        if isinstance(model, Pipeline):  # the schedule: forward + backward of the micro-batch
            run.pipeline_step(model, batch["input"], batch["target"])
        else:
            with run.loss_parallel():  # a no-op unless parallel.loss_parallel = true
                loss = model(batch["input"], batch["target"])
            run.backward(loss)
        run.optimizer_step(opt)

    end = validate(run, model, val)
    path = run.save_checkpoint()
    if run.is_main:
        report(run, model_cfg.vocab_size, start, end, len(val), path)
    run.close()


def sizes(train: TokenDataset, val: Subset[dict[str, Tensor]]) -> str:
    return f"{len(train)} train / {len(val)} val samples of {train.seq_len} tokens"


def report(
    run: meshrun.Run,
    vocab: int,
    start: tuple[int, float],
    end: tuple[int, float],
    n_val: int,
    path: Path,
) -> None:
    """What the run proves. A byte-level model's samples stay noise until its loss is far
    below what a short run reaches, so the evidence is the loss itself: against the start,
    and against a uniform guess over the vocabulary (what a model that learned nothing
    scores)."""
    rate = run.summary().get("tokens_per_s", 0.0)  # median over the steps
    run.log.info(
        "validation loss (exact, %d windows): step %d %.4f -> step %d %.4f nats per token "
        "(%.2f bits); a uniform guess over the %d ids scores ln %d = %.4f",
        *(n_val, *start, *end, end[1] / math.log(2), vocab, vocab, math.log(vocab)),
    )
    run.log.info("throughput %s tokens/s | checkpoint %s", f"{rate:,.0f}", path)


if __name__ == "__main__":
    main()
