"""Predicted (``meshrun plan``) against measured peak memory and step time on one GPU.

A GPT of about 1B parameters (the demo GPT class at GPT-2-like width: 16 layers, hidden 2048,
16 heads, vocab 50,304, sequence 2,048), trained in bf16 autocast with fused AdamW, with and
without activation checkpointing of every block. The peak is
``torch.cuda.max_memory_allocated`` over the timed steps; the step time the median of them.
The prediction is the planner's ``evaluate`` for the single-GPU layout (the GPU found in its
table by name, its peak bf16 FLOP/s and memory, the default achievable fraction 0.5), with the
model counted exactly on the meta device.

    .venv/bin/python benchmarks/plan_vs_gpu.py [--micro-batch 8] [--steps 6] [--skip 2]
    .venv/bin/python benchmarks/plan_vs_gpu.py --device cpu --tiny   # a smoke run, no GPU

The planner's memory is model states (16 bytes/param: AMP keeps fp32 weights and gradients
and AdamW's two fp32 moments, the ZeRO paper's 2 + 2 + 12 in another split) + activations
(Korthikanti et al. with fused attention) + the stated allowance; the allocator peak has no
CUDA context, so the comparison leaves the allowance out. Record the figures in docs/plan.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.checkpoint import checkpoint

from meshrun.demo.model import GPT, GPTConfig
from meshrun.plan.cost import GB, Cluster, Layout, Model, Training, evaluate
from meshrun.specs.gpus import GPUS


def gpt_1b(tiny: bool) -> GPTConfig:
    if tiny:
        return GPTConfig(vocab_size=512, seq_len=128, n_layer=2, n_head=4, d_model=128)
    return GPTConfig(vocab_size=50304, seq_len=2048, n_layer=16, n_head=16, d_model=2048)


def apply_full_ac(model: GPT) -> None:
    """Recompute every block in backward (full recomputation)."""
    for block in model.blocks:
        forward = block.forward
        block.forward = lambda x, f=forward: checkpoint(f, x, use_reentrant=False)  # type: ignore[method-assign]


def measure(
    cfg: GPTConfig, ac: bool, micro_batch: int, steps: int, skip: int, device: torch.device
) -> tuple[float, float]:
    """(peak bytes, median step seconds) of bf16-autocast training with fused AdamW."""
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if ac:
        apply_full_ac(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), device=device)
    cuda = device.type == "cuda"
    times = []
    for step in range(steps):
        if step == skip and cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= skip:
            times.append(time.perf_counter() - start)
    peak = float(torch.cuda.max_memory_allocated()) if cuda else float("nan")
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return peak, statistics.median(times)


def predict(cfg: GPTConfig, ac: bool, micro_batch: int, gpu_name: str) -> tuple[float, float]:
    """(bytes without the allowance, step seconds) from the planner."""
    with torch.device("meta"):
        meta = GPT(cfg)
    params = sum(p.numel() for p in meta.parameters())
    layer = sum(p.numel() for p in meta.blocks[0].parameters())
    m = Model(
        layers=cfg.n_layer,
        hidden=cfg.d_model,
        heads=cfg.n_head,
        vocab=cfg.vocab_size,
        seq=cfg.seq_len,
        ffn=cfg.ffn_mult * cfg.d_model,
        params=params,
        layer_params=layer,
    )
    gpu = GPUS[gpu_name]
    c = Cluster(
        1,
        1,
        gpu.memory_gb * GB,
        gpu.bf16_flops,
        gpu.intra_bw,
        gpu.inter_bw,
        allowance_bytes=0.0,
        fragmentation=0.0,
        mem_bw=gpu.mem_bw,
    )
    lay = Layout(
        dp_shard=1, micro_batch=micro_batch, activation_checkpointing="full" if ac else "none"
    )
    e = evaluate(m, lay, Training(global_batch=micro_batch), c)
    assert e.time is not None
    return e.memory.total, e.time.total


def gpu_table_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "h100-sxm"  # a stand-in: the smoke run only exercises the code
    name = torch.cuda.get_device_name(device).lower()
    for key, entry in (
        ("h200", "h200"),
        ("h100 pcie", "h100-pcie"),
        ("h100", "h100-sxm"),
        ("b200", "b200"),
        ("a100", "a100-80gb"),
        ("l40s", "l40s"),
        ("mi300x", "mi300x"),
    ):
        if key in name:
            return entry
    raise SystemExit(f"GPU {name!r} is not in meshrun's table; add it to specs/gpus.py")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a small model (smoke run)")
    a = p.parse_args()
    device = torch.device(a.device)
    cfg = gpt_1b(a.tiny)
    gpu = gpu_table_name(device)
    print(f"{gpu}, micro-batch {a.micro_batch}, seq {cfg.seq_len}, bf16 autocast, AdamW")
    print(
        f"{'AC':>5} {'pred GB':>8} {'meas GB':>8} {'ratio':>6} {'pred s':>8} {'meas s':>8} "
        f"{'ratio':>6}"
    )
    for ac in (False, True):
        pm, pt = predict(cfg, ac, a.micro_batch, gpu)
        mm, mt = measure(cfg, ac, a.micro_batch, a.steps, a.skip, device)
        print(
            f"{'full' if ac else 'none':>5} {pm / GB:>8.2f} {mm / GB:>8.2f} {mm / pm:>6.2f} "
            f"{pt:>8.3f} {mt:>8.3f} {mt / pt:>6.2f}"
        )


if __name__ == "__main__":
    main()
