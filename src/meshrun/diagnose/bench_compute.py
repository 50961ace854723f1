"""``meshrun bench compute``'s measurements and the two layer-level cases of ``bench comm``, run
in every worker: matmul, the demo GPT's step, a memory copy and AdamW's step (``bench_compute``);
DTensor's cost per tensor-parallel linear layer (``bench_tp``) and FSDP2's cost per unit
collective (``bench_fsdp``), beyond what the collective sweep predicts."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from meshrun.diagnose.bench_comm import gather_scatter, timed, timed_collective

TP_BENCH_BLOCKS = 4  # MLP pairs in the stack bench_tp splits


# Its input: the demo GPT's micro-batch of bench_compute (8 x 128 tokens, hidden 256), so that
# the ranks compute as long between two all-reduces as in a real block (and drift as far).
TP_BENCH_TOKENS = 8 * 128


TP_BENCH_HIDDEN = 256


def bench_tp(device: Any, seconds: float) -> dict[str, float]:
    """The cost per tensor-parallel linear layer, forward + backward, beyond its math and its
    all-reduce.

    A stack of MLP pairs (up ColwiseParallel, down RowwiseParallel: Megatron's layout, as
    meshrun's default plan) split over all ranks by ``parallelize_module``, at the demo GPT's
    size (as bench_compute's model), against the same local shards as plain modules; each pair
    issues two all-reduces (its output forward, its input gradient backward), timed alone
    (back to back) and taken out, so ``tp_layer_overhead`` = (t_tp - t_local - 2 x pairs x
    t_all_reduce) / (2 x pairs) is DTensor's dispatch (from_local/to_local, redistribute,
    autograd wrappers) plus the waiting at each all-reduce for the partner that drifted (on a
    CPU, a process woken after the others). Also returned: the three times, for the record."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = dist.get_world_size()
    h = -(-TP_BENCH_HIDDEN // n) * n  # divisible by the group
    plan: dict[str, Any] = {}
    for i in range(TP_BENCH_BLOCKS):
        plan[f"{i}.0"], plan[f"{i}.1"] = ColwiseParallel(), RowwiseParallel()
    mesh = init_device_mesh(device.type, (n,))
    split = parallelize_module(_mlp_stack(h, 4 * h, device), mesh, plan)
    local = _mlp_stack(h, 4 * h // n, device)
    # The input wants a gradient, so the first pair also all-reduces its input's, as in a block.
    x = torch.randn(TP_BENCH_TOKENS, h, device=device, requires_grad=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    buf = torch.ones(TP_BENCH_TOKENS * h, device=device)
    rounds = []
    for _ in range(3):  # interleaved rounds, medians (as bench_compute): the load moves
        t_tp = timed_collective(lambda: split(x).sum().backward(), seconds, device)
        t_local = timed(lambda: local(x).sum().backward(), seconds, sync)
        t_ar = timed_collective(lambda: dist.all_reduce(buf), seconds, device)
        rounds.append((t_tp, t_local, t_ar))
    linears = 2 * TP_BENCH_BLOCKS
    extra = statistics.median((tp - lo - linears * ar) / linears for tp, lo, ar in rounds)
    t_tp, t_local, t_ar = (statistics.median(r[i] for r in rounds) for i in range(3))
    return {
        "tp_layer_overhead": max(0.0, extra),
        "tp_stack_s": t_tp,
        "local_stack_s": t_local,
        "all_reduce_s": t_ar,
    }


def _mlp_stack(h: int, inner: int, device: Any) -> Any:
    from torch import nn

    blocks = [
        nn.Sequential(nn.Linear(h, inner, bias=False), nn.Linear(inner, h, bias=False))
        for _ in range(TP_BENCH_BLOCKS)
    ]
    return nn.Sequential(*blocks).to(device)


FSDP_BENCH_BLOCKS = 2  # demo-GPT blocks in the stack bench_fsdp shards (cost: per collective)


def bench_fsdp(device: Any, seconds: float) -> dict[str, float]:
    """The cost per collective FSDP2 issues (a unit's all-gather or reduce-scatter), forward +
    backward, beyond its bytes and ring steps, its modelled copies and the math.

    A stack of demo-GPT blocks ("small") with ``fully_shard`` on each (ZeRO-3: resharded after
    forward, so every block all-gathers in forward and in backward and reduce-scatters: 3
    collectives per block), over all ranks, on bench_compute's micro-batch (8 x 128 tokens),
    against the same blocks unsharded as plain modules; one block's all-gather and
    reduce-scatter timed alone (back to back) and a 64 MiB copy (the planner's ``mem_bw``)
    taken out, so ``fsdp_unit_overhead`` = (t_fsdp - t_local - blocks x (2 t_ag + t_rs) -
    copies) / (3 x blocks), copies = 2 (1 + 1/n) x the gathered and reduced bytes / mem_bw as
    in the planner. What is left: FSDP2's per-unit hooks and DTensor bookkeeping and, on a
    CPU, the wait at each blocking collective for the slower rank. Also returned: the times."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    sharded, local, block_bytes = _fsdp_stacks(device, n)
    x = torch.randn(8, 128, local[0].mlp_norm.normalized_shape[0], device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    numel = -(-block_bytes // 4 // n) * n  # one block's fp32 elements, divisible by n
    full, part = torch.ones(numel, device=device), torch.empty(numel // n, device=device)
    gather, scatter = gather_scatter()
    big = torch.empty(2**24, device=device)
    copy = torch.empty_like(big)
    rounds = []
    for _ in range(3):  # interleaved rounds, medians (as bench_tp): the load moves
        t_fsdp = timed_collective(lambda: sharded(x).sum().backward(), seconds, device)
        t_local = timed(lambda: local(x).sum().backward(), seconds, sync)
        t_ag = timed_collective(lambda: gather(full, part), seconds, device)
        t_rs = timed_collective(lambda: scatter(part, full), seconds, device)
        mem_bw = 2.0 * big.numel() * 4 / timed(lambda: copy.copy_(big), seconds, sync)
        rounds.append((t_fsdp, t_local, t_ag, t_rs, mem_bw))
    extra = statistics.median(_fsdp_per_collective(r, n, float(numel * 4)) for r in rounds)
    keys = ("fsdp_stack_s", "local_stack_s", "all_gather_s", "reduce_scatter_s", "mem_bw")
    out = {k: statistics.median(r[i] for r in rounds) for i, k in enumerate(keys)}
    return {"fsdp_unit_overhead": max(0.0, extra), **out}


def _fsdp_stacks(device: Any, n: int) -> tuple[Any, Any, int]:
    """The stack with ``fully_shard`` on each block and on the whole, the same blocks plain,
    and one block's bytes."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same blocks on every rank (fully_shard shards what it is given)
    sharded, local = _block_stack(device), _block_stack(device)
    block_bytes = sum(p.numel() * p.element_size() for p in local[0].parameters())
    mesh = init_device_mesh(device.type, (n,))
    for block in sharded:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(sharded, mesh=mesh)
    return sharded, local, block_bytes


def _fsdp_per_collective(r: tuple[float, ...], n: int, nbytes: float) -> float:
    """One round's time per FSDP2 collective beyond bytes, ring steps, copies and math."""
    t_fsdp, t_local, t_ag, t_rs, mem_bw = r
    blocks = FSDP_BENCH_BLOCKS
    copies = 2.0 * (1.0 + 1.0 / n) * 3 * blocks * nbytes / mem_bw
    return (t_fsdp - t_local - blocks * (2 * t_ag + t_rs) - copies) / (3 * blocks)


def _block_stack(device: Any) -> Any:
    from torch import nn

    from meshrun.demo.model import Block, demo_config

    cfg = demo_config("small")
    return nn.Sequential(*(Block(cfg) for _ in range(FSDP_BENCH_BLOCKS))).to(device)


def bench_compute(device: Any, precision: str, seconds: float) -> dict[str, float]:
    """Matmul FLOP/s (the peak) and the demo GPT's training FLOP/s on this rank."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    # Interleaved rounds, medians: a neighbour's load then hits both figures alike, and the
    # ratio (the achievable fraction) is steadier than either.
    matmul, model, optim = [], [], []
    for _ in range(3):
        matmul.append(2.0 * n**3 / timed(lambda: a @ b, seconds, sync))
        model.append(_model_flops(device, seconds, sync))
        optim.append(_optimizer_bw(device, seconds, sync))
    big = torch.empty(2**24, device=device)  # 64 MiB: past every cache
    copy = torch.empty_like(big)
    mem_bw = 2.0 * big.numel() * 4 / timed(lambda: copy.copy_(big), seconds, sync)
    return {
        "matmul_flops": statistics.median(matmul),
        "model_flops": statistics.median(model),
        "mem_bw": mem_bw,
        "optimizer_bw": statistics.median(optim),
    }


def _optimizer_bw(device: Any, seconds: float, sync: Callable[[], None]) -> float:
    """AdamW's step over the demo GPT's parameters, as the bytes per second of the planner's
    optimizer model (28 bytes per parameter): it includes the per-tensor launch costs."""
    import torch

    from meshrun.demo.model import GPT, demo_config

    cfg = demo_config("small")
    model = GPT(cfg).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    return 28.0 * params / timed(opt.step, seconds, sync)


def _model_flops(device: Any, seconds: float, sync: Callable[[], None]) -> float:
    """The demo GPT ("small", micro-batch 8) forward + backward: formula FLOPs per second."""
    import torch

    from meshrun.demo.model import GPT, demo_config
    from meshrun.plan.cost import Model, flops_per_iteration

    cfg = demo_config("small")
    model = GPT(cfg).to(device)
    batch = 8
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)

    def step() -> None:
        model(x, x).backward()

    shape = Model(
        layers=cfg.n_layer,
        hidden=cfg.d_model,
        heads=cfg.n_head,
        vocab=cfg.vocab_size,
        seq=cfg.seq_len,
        ffn=cfg.ffn_mult * cfg.d_model,
    )
    return flops_per_iteration(shape, batch) / timed(step, seconds, sync)


def slowest_rank_rates(values: dict[str, float], device: Any) -> dict[str, float]:
    """Each rate (FLOP/s, bytes/s) of the slowest rank: a synchronous step, whose collectives
    wait for every rank, goes at that rank's pace, not at the mean's."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return dict(zip(values, t.tolist(), strict=True))
