"""The torch-only side of ``benchmarks/overhead.py``: what anyone would write without meshrun.

``plain.py --result ... --steps ...`` (``--mode step``, variant A): a hand-written DDP loop for
the demo GPT: ``init_process_group("gloo")``, DDP, AdamW, a warmup + cosine LambdaLR, gradient
accumulation with ``no_sync()`` on the non-boundary micro-steps and the loss scaled by
1/accum. It reads the same global batches as meshrun's ``run.dataloader`` (same seeded
permutation, rank r taking every world-th sample of each global batch), so both variants train
on the same data from the same initial weights and their losses can be compared.

``plain.py --bare`` (``--mode launch``): what any launcher must start. It joins the process
group, runs one all-reduce (so every rank really met the others) and leaves; the launcher's
own cost is then most of what differs between two launchers. It reads no flags and loads no
demo module.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from common import Clock, parse_worker_args, write_result
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

DEMO_DIR = Path(__file__).resolve().parents[2] / "src" / "meshrun" / "demo"
DATA_DIR = DEMO_DIR.parent / "data"


def load_demo_module(name: str) -> ModuleType:
    """Load ``meshrun/demo/<name>.py`` by path. ``import meshrun.demo.model`` would run
    ``meshrun/__init__.py`` (process-group code, rich, numpy) and charge meshrun's import time
    to the plain variant's startup; the demo model and corpus themselves need only torch."""
    return load_module(DEMO_DIR / f"{name}.py", f"_plain_{name}")


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def rank_indices(
    n: int, steps: int, global_batch: int, rank: int, world: int, seed: int
) -> list[int]:
    """This rank's dataset indices for ``steps`` global batches, in meshrun's order: stream
    position p is epoch ``p // n``'s keyed permutation at ``p % n`` and rank r takes positions
    r, r + world, ... of each global batch. The permutation module is loaded by path, as the
    demo's modules are: it needs only NumPy, not meshrun's package."""
    perm = load_module(DATA_DIR / "permutation.py", "_plain_permutation")
    perms: dict[int, object] = {}
    out: list[int] = []
    for step in range(steps):
        for pos in range(step * global_batch + rank, (step + 1) * global_batch, world):
            epoch = pos // n
            if epoch not in perms:
                perms[epoch] = perm.KeyedPermutation(n, perm.mix_seed(seed, epoch))
            out.append(perms[epoch].at(pos % n))  # type: ignore[attr-defined]
    return out


def bare() -> None:
    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == dist.get_world_size(), value
    dist.destroy_process_group()


def train() -> None:
    clock = Clock()
    args = parse_worker_args()
    model_mod, corpus_mod = load_demo_module("model"), load_demo_module("corpus")
    clock.mark("imported")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    accum = args.global_batch // (args.micro_batch * world)
    clock.mark("initialized")

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    cfg = model_mod.demo_config(args.size)
    model = DDP(model_mod.GPT(cfg))
    opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )

    def lr_factor(step: int) -> float:  # linear warmup, then cosine down to min_lr_ratio
        if step < args.warmup_steps:
            return (step + 1) / (args.warmup_steps + 1)
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * progress)
        )

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    clock.mark("model")

    train, _ = corpus_mod.build_demo_datasets(cfg.seq_len, limit_bytes=args.corpus_bytes)
    indices = rank_indices(len(train), args.steps, args.global_batch, rank, world, args.seed)
    batches = iter(DataLoader(train, batch_size=args.micro_batch, sampler=indices))
    clock.mark("data")

    clock.start_steps()
    loss_sum = torch.zeros(())
    for _ in range(args.steps):
        loss_sum = torch.zeros(())
        for micro in range(accum):
            batch = next(batches)
            # Gradients are all-reduced only on the last micro-step of the window.
            sync = nullcontext() if micro == accum - 1 else model.no_sync()
            with sync:
                loss = model(batch["input"], batch["target"])
                (loss / accum).backward()
            loss_sum += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        clock.end_step()

    # The last step's loss over the whole global batch, once, after the timed steps.
    mean = loss_sum / accum
    dist.all_reduce(mean)
    if rank == 0:
        write_result(
            args.result,
            "plain",
            clock,
            args.skip,
            final_loss=float(mean) / world,
            world_size=world,
            accum=accum,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:] == ["--bare"]:
        bare()
    else:
        train()
    # Leave as @meshrun.main does: Gloo's threads can abort the interpreter's teardown
    # (SIGABRT, "terminate called without an active exception"; 8-40% of bare runs measured
    # here) after the result is written: a failed run would stop the benchmark.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
