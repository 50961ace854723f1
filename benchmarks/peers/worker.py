"""One run of the peers benchmark: the demo GPT trained by one framework under one layout.

Started by ``benchmarks/peers.py`` through torchrun (``--nproc-per-node 2``), one process per
rank, for one framework and one ZeRO stage:

- ``meshrun``: ``meshrun.parallel.parallelize`` / ``build_optimizer`` / ``clip_grad_norm_``
  (zero 0 = DDP, 1 = ZeroRedundancyOptimizer, 2/3 = FSDP2 without/with resharding);
- ``accelerate``: ``Accelerator`` (zero 0 = its DDP; 2/3 = its FSDP plugin, FSDP2);
- ``fabric``: Lightning ``Fabric`` (zero 0 = ``ddp``; 2/3 = ``FSDPStrategy`` SHARD_GRAD_OP /
  FULL_SHARD);
- ``deepspeed``: ``deepspeed.initialize`` with ZeRO stage 0-3 (``DS_ACCELERATOR=cpu``).

Every framework gets the same model (``GPT(demo_config(size))`` built under seed 0), the same
data (rank r draws its tokens from a generator seeded with r), the same optimizer (torch AdamW,
lr 1e-3, no weight decay), fp32, and the same clipping (global norm 1.0), in the same loop:
forward, backward, clip, step, zero_grad, barrier. The step time is measured from before the
forward to after the barrier, so it is the slowest rank's; the CPU time of each step (the
process's, every thread) is recorded too: on a machine loaded by other work it moves far less
than wall time. Before it writes its result each
run checks that it really was distributed and in sync: the world size is 2 and a fingerprint
of the full (gathered) parameters agrees across ranks. The loss is the global mean, reduced
outside the timed region.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from meshrun.demo.model import GPT, Block, demo_config

LR = 1e-3
MAX_NORM = 1.0


class Unavailable(Exception):
    """This framework cannot run this layout here (the reason is printed, the run skipped)."""


@dataclass
class Trainer:
    """What the loop needs from a framework: the wrapped model, one optimizer step after the
    forward, and a context in which ``model.parameters()`` are whole (for the fingerprint)."""

    model: nn.Module
    step: Callable[[Tensor], None]  # backward(loss), clip, optimizer step, zero_grad
    full_params: Callable[[], AbstractContextManager[Any]] = nullcontext


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def adamw(params: Iterator[nn.Parameter] | list[nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def setup_meshrun(model: nn.Module, zero: int) -> Trainer:
    from meshrun.config import JobConfig, ParallelConfig
    from meshrun.parallel import build_optimizer, parallelize
    from meshrun.parallel.grads import clip_grad_norm_
    from meshrun.runtime.hostmem import set_mmap_threshold
    from meshrun.runtime.mesh import ParallelDims, build_mesh

    set_mmap_threshold(JobConfig().cpu_mmap_threshold_kib)  # meshrun.init()'s default on CPU
    cfg = ParallelConfig(zero=zero)
    mesh = build_mesh(ParallelDims.from_config(cfg, dist.get_world_size()), "cpu")
    model = parallelize(model, mesh, cfg, torch.device("cpu"))
    opt = build_optimizer(model, torch.optim.AdamW, mesh, cfg, lr=LR, weight_decay=0.0)

    def step(loss: Tensor) -> None:
        loss.backward()
        clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Trainer(model, step)


def setup_accelerate(model: nn.Module, zero: int) -> Trainer:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = None
    if zero in (2, 3):
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            reshard_after_forward=zero == 3,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=[Block.__name__],
            state_dict_type="FULL_STATE_DICT",
        )
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    assert acc.num_processes == dist.get_world_size(), acc.state
    if plugin is not None and not acc.is_fsdp2:
        # Measured with accelerate 1.15: on CPU the state stays MULTI_CPU and the plugin is
        # dropped without a word, so prepare() would return plain DDP under a ZeRO label.
        raise Unavailable(
            f"Accelerate ignores fsdp_plugin on CPU (distributed_type={acc.distributed_type})"
        )
    opt = adamw(model.parameters())
    model, opt = acc.prepare(model, opt)

    def step(loss: Tensor) -> None:
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Trainer(model, step)


def setup_fabric(model: nn.Module, zero: int) -> Trainer:
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import FSDPStrategy

    strategy: Any = "ddp"
    if zero in (2, 3):
        strategy = FSDPStrategy(
            sharding_strategy="FULL_SHARD" if zero == 3 else "SHARD_GRAD_OP",
            auto_wrap_policy={Block},
            use_orig_params=True,
        )
    try:
        fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    except ValueError as e:  # FSDPStrategy: "FSDP is only available on GPU"
        raise Unavailable(f"Lightning Fabric refuses FSDPStrategy on CPU: {e}") from e
    fabric.launch()
    assert fabric.world_size == dist.get_world_size()
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(adamw(model.parameters()))

    def step(loss: Tensor) -> None:
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def full_params() -> AbstractContextManager[Any]:
        if zero in (2, 3):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            return FSDP.summon_full_params(model, writeback=False)
        return nullcontext()

    return Trainer(model, step, full_params)


def setup_deepspeed(model: nn.Module, zero: int, micro_batch: int) -> Trainer:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": MAX_NORM,  # set explicitly: the same clip as every other variant
        "zero_optimization": {"stage": zero},
        "zero_allow_untested_optimizer": True,  # torch's AdamW, as the others use
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=adamw(model.parameters()), config=config
    )
    assert engine.world_size == dist.get_world_size()

    def step(loss: Tensor) -> None:
        engine.backward(loss)
        engine.step()  # clips, steps and zeroes the gradients

    def full_params() -> AbstractContextManager[Any]:
        if zero == 3:
            return deepspeed.zero.GatheredParameters(list(engine.module.parameters()))
        return nullcontext()

    return Trainer(engine, step, full_params)


def init_process_group(framework: str) -> None:
    if framework == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    elif framework == "accelerate":
        # cpu=True is needed: without it, Accelerator() under torchrun on a machine without
        # GPUs was measured to train every rank alone, without any gradient sync.
        from accelerate import PartialState

        PartialState(cpu=True)
    else:
        dist.init_process_group("gloo")


def whole_tensor(t: Tensor) -> Tensor:
    """FSDP2 (meshrun, Accelerate) holds DTensor shards: gather them."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def fingerprint(trainer: Trainer) -> list[float]:
    """Sum, norm and a fixed random projection of all parameters, gathered whole."""
    with trainer.full_params():
        whole = [whole_tensor(p.detach()) for p in trainer.model.parameters()]
    flat = torch.cat([t.reshape(-1).double() for t in whole])
    w = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return [float(flat.sum()), float(flat.norm()), float((flat * w).sum())]


def check_in_sync(trainer: Trainer, world: int) -> list[float]:
    """Every rank holds the same parameters: otherwise the run was not data-parallel."""
    mine = fingerprint(trainer)
    all_fps: list[list[float] | None] = [None] * world
    dist.all_gather_object(all_fps, mine)
    for rank, fp in enumerate(all_fps):
        assert fp is not None
        diff = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(fp, mine, strict=True))
        if diff > 1e-6:
            raise AssertionError(f"rank {rank} parameters differ from this rank's: {fp} {mine}")
    return mine


def train(args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.world:
        raise AssertionError(f"{args.framework}: world size {world}, expected {args.world}")
    cfg = demo_config(args.size)
    torch.manual_seed(0)
    model = GPT(cfg)
    per_rank = args.global_batch // world
    rss_before = rss_bytes()
    if args.framework == "deepspeed":
        trainer = setup_deepspeed(model, args.zero, per_rank)
    else:
        trainer = SETUPS[args.framework](model, args.zero)
    gen = torch.Generator().manual_seed(rank)
    times, cpu, losses = [], [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (per_rank, cfg.seq_len + 1), generator=gen)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = trainer.model(tokens[:, :-1], tokens[:, 1:])
        trainer.step(loss)
        cpu.append(time.process_time() - c0)  # all threads of this process, Gloo's included
        dist.barrier()
        times.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return {
        "framework": args.framework,
        "zero": args.zero,
        "world": world,
        "step_s": statistics.median(times[args.skip :]),
        "times": times,
        "cpu_s": statistics.median(cpu[args.skip :]),
        "losses": losses,
        "wrapper": type(trainer.model).__name__,
        "threads": torch.get_num_threads(),
        "rss_setup": rss_before,
        "rss": rss_bytes(),
        "fingerprint": check_in_sync(trainer, world),
    }


SETUPS: dict[str, Callable[[nn.Module, int], Trainer]] = {
    "meshrun": setup_meshrun,
    "accelerate": setup_accelerate,
    "fabric": setup_fabric,
}


def main() -> None:
    p = argparse.ArgumentParser(description="one peers-benchmark run (see benchmarks/peers.py)")
    p.add_argument("--framework", required=True, choices=[*SETUPS, "deepspeed"])
    p.add_argument("--zero", type=int, required=True, choices=[0, 1, 2, 3])
    p.add_argument("--size", required=True, choices=["tiny", "small"])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--skip", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--result", type=Path, required=True, help="one JSON line per rank")
    args = p.parse_args()
    torch.set_num_threads(1)
    init_process_group(args.framework)
    try:
        result = train(args)
    except Unavailable as e:
        result = {"framework": args.framework, "zero": args.zero, "unavailable": str(e)}
    rows: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, result)
    if dist.get_rank() == 0:
        args.result.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # a Gloo worker can abort in interpreter teardown (see tests/_dist.py)


if __name__ == "__main__":
    main()
