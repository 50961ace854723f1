"""Expert parallel (``parallel.ep = 2``) against replicated experts: step time, model-state
bytes and peak RSS per rank, on CPU (issue 29).

```
.venv/bin/python benchmarks/moe_ep.py [--repeats 3] [--steps 8] [--skip 3] [--out results.json]
```

A Mixtral-shaped MoE built from its config (hidden 256, 8 experts of intermediate 1024, top-2,
4 layers; 96% of its 26.2M parameters are experts) trains with AdamW on 2 Gloo ranks (the
same global batch of 8 sequences of 64 tokens), each variant in its own spawned world of
processes (``OMP_NUM_THREADS=1``) so that its peak RSS is its own:

- ``DDP, experts replicated``: every rank holds all 8 experts (``ep = 1``);
- ``DDP, ep 2``: each rank holds 4 experts, tokens exchanged with ``all_to_all``;
- ``ZeRO-3, experts sharded``: FSDP2 over 2 ranks shards every parameter, experts included;
- ``ZeRO-3, ep 2``: the experts split by expert, the rest sharded by FSDP2.

Runs are interleaved (round 1: every variant once, round 2: again, ...) so a machine that gets
busier hits every variant alike; the table shows the median over rounds of each run's median
step time (the first ``--skip`` steps are warm-up), of the model state (parameters +
gradients + AdamW state, local tensors, max over ranks) and of the peak RSS (``ru_maxrss``,
max over ranks; it includes torch itself), and the ratios to the replicated layout.
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
from torch import nn

from meshrun.config import ParallelConfig, check_layout
from meshrun.parallel import build_optimizer, parallelize
from meshrun.runtime.mesh import ParallelDims, build_mesh

GLOBAL_BATCH, SEQ, VOCAB = 8, 64, 512
VARIANTS: dict[str, dict[str, Any]] = {
    "DDP, experts replicated": {"zero": 0},
    "DDP, ep 2": {"zero": 0, "ep": 2},
    "ZeRO-3, experts sharded": {"zero": 3},
    "ZeRO-3, ep 2": {"zero": 3, "ep": 2},
}
BASE = {"DDP, ep 2": "DDP, experts replicated", "ZeRO-3, ep 2": "ZeRO-3, experts sharded"}


def build_model() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MixtralForCausalLM(cfg)


def train(rank: int, variant: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    cfg = ParallelConfig(**variant)
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    check_layout(cfg, vars(dims))
    mesh = build_mesh(dims, "cpu")
    model = parallelize(build_model(), mesh, cfg, torch.device("cpu"))
    opt = build_optimizer(model, torch.optim.AdamW, mesh, cfg, lr=1e-3)
    per_rank = GLOBAL_BATCH // dims.dp
    g = torch.Generator().manual_seed(dims.dp_rank(rank))

    def forward_backward() -> None:
        tokens = torch.randint(0, VOCAB, (per_rank, SEQ + 1), generator=g)
        logits = model(tokens[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    return timed_steps(forward_backward, opt, args.steps, args.skip)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    runs: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.repeats):  # interleaved: each round runs every variant once
        for name, variant in VARIANTS.items():
            runs.setdefault(name, []).append(run_world(2, train, variant, args))
            print(f"  {name}: {runs[name][-1]}", flush=True)
    model = build_model()
    n = sum(x.numel() for x in model.parameters())
    experts = sum(x.numel() for k, x in model.named_parameters() if ".experts." in k)
    print(
        f"\nMixtral-shaped MoE, {n / 1e6:.1f}M parameters ({experts / n:.0%} experts), AdamW, "
        f"2 ranks, global batch {GLOBAL_BATCH} x {SEQ} tokens, {args.repeats} interleaved rounds"
    )
    print(
        "| layout | step (s, median) | vs base | model state / rank (MiB) | vs base | "
        "peak RSS / rank (MiB) | vs base |"
    )
    print("|---|---|---|---|---|---|---|")
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("step_s", "bytes", "rss")}
        for name, rs in runs.items()
    }
    for name, row in med.items():
        base = med[BASE.get(name, name)]  # ep 2 against the same data-parallel layout
        print(
            f"| {name} | {row['step_s']:.3f} | {row['step_s'] / base['step_s']:.2f}x | "
            f"{row['bytes'] / 2**20:.1f} | {row['bytes'] / base['bytes']:.2f}x | "
            f"{row['rss'] / 2**20:.0f} | {row['rss'] / base['rss']:.2f}x |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(med, indent=2))


if __name__ == "__main__":
    main()
