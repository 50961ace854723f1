"""A small GPT trained the way nanoGPT's train.py trains one, with meshrun doing the distributed
part: the script keeps its own argument parser, its model (with its own weight-decay parameter
groups and a tied embedding), its periodic evaluation and its prints; meshrun takes the
processes, the layout, the batch arithmetic, the LR schedule, the checkpoints and the loop.

    meshrun launch --nproc-per-node 2 examples/nanogpt_style.py --optim.steps=200
    ... --parallel.zero=1 | 2 | 3           ZeRO-1/2/3 instead of DDP (the default)
    ... --n_layer 4 --n_embd 128            the script's own flags, nanoGPT's names
    ... --data.micro_batch=16 --optim.warmup_steps=20 --checkpoint.interval=50

The lines marked ``# [meshrun]`` are the ones a nanoGPT-style script changes; docs/porting.md
walks through each. The data is the bytes of Python's own argparse.py: nothing to download.
(Tensor and pipeline parallelism need a model whose attention projections can be split: the
fused q/k/v projection here cannot; see examples/hf_causal_lm.py.)
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

import meshrun


def parse_args() -> argparse.Namespace:
    # Strict on purpose (parse_args, not parse_known_args): meshrun.init() has taken its own
    # --section.key=value flags out of sys.argv already.
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_head", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=64)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eval_interval", type=int, default=10, help="optimizer steps between evals")
    p.add_argument("--eval_iters", type=int, default=4, help="batches per evaluation and rank")
    return p.parse_args()


# --- the model: the script's own. meshrun reads its structure (the blocks in `h`, the head
# tied to the token embedding) from the module itself.


@dataclass
class GPTConfig:
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float
    vocab_size: int = 256  # bytes


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # one matmul for q, k and v
        self.out = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        heads = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(*heads, dropout_p=drop, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied: one matrix reads and writes the vocabulary
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # small weights; residual outputs smaller with depth (GPT-2's rule)
                depth = (
                    math.sqrt(2 * cfg.n_layer) if name.endswith(("out.weight", "2.weight")) else 1
                )
                nn.init.normal_(p, std=0.02 / depth)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def param_groups(self, weight_decay: float) -> list[dict[str, object]]:
        """Weight decay on the matrices (embeddings, linear weights), none on biases and norms."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]


class Windows(Dataset[tuple[Tensor, Tensor]]):
    """Next-byte prediction over a byte string: window i is (x, x shifted by one)."""

    def __init__(self, data: Tensor, block_size: int) -> None:
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


def estimate_loss(run: meshrun.Run, model: nn.Module, val: Windows, eval_iters: int) -> float:
    """The mean validation loss, computed on every rank (a rank-0-only forward would wait
    forever under ZeRO-3, whose forward all-gathers the parameters)."""
    batches = run.dataloader(val, mode="eval")  # [meshrun] each window once across the ranks
    return run.evaluate(model, batches, lambda m, b: m(*b)[1], max_batches=eval_iters)  # [meshrun]


@meshrun.main  # [meshrun] tracebacks reach the launcher; a clean exit on every rank
def main() -> None:
    run = meshrun.init()  # [meshrun] takes --section.key=value out of sys.argv
    args = parse_args()
    data = torch.tensor(list(Path(argparse.__file__).read_bytes()), dtype=torch.long)
    split = int(0.9 * len(data))
    train, val = Windows(data[:split], args.block_size), Windows(data[split:], args.block_size)
    cfg = GPTConfig(args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout)
    model = run.parallelize(GPT(cfg))  # [meshrun] DDP / ZeRO-1/2/3 / HSDP from [parallel]
    raw_model = run.unwrap(model)  # [meshrun] the GPT itself, under every layout
    groups = raw_model.param_groups(args.weight_decay)  # what configure_optimizers made
    lr = run.scaled_lr(args.learning_rate)  # [meshrun] optim.lr_scaling to the global batch
    betas = (args.beta1, args.beta2)
    # After parallelize: ZeRO-3 replaces the parameters; under ZeRO-1 this shards AdamW's state.
    optimizer = run.optimizer(model, torch.optim.AdamW, groups, lr=lr, betas=betas)  # [meshrun]
    run.lr_scheduler(optimizer)  # [meshrun] warmup + decay from [optim]
    loader = run.dataloader(train)  # [meshrun] this rank's share, resumable
    run.resume(model, optimizer, loader)  # [meshrun] the newest valid checkpoint, if any
    start = estimate_loss(run, model, val, args.eval_iters)  # on every rank, as each eval
    if run.is_main:
        n = sum(p.numel() for p in raw_model.parameters())
        print(f"{n / 1e6:.2f}M parameters, {len(train)} train / {len(val)} val windows")
        print(f"step {run.step}: val loss {start:.4f}")
    for x, y in run.steps(loader):  # [meshrun] micro-batches until optim.steps
        _, loss = model(x, y)
        run.backward(loss)  # [meshrun] / accumulation; grads reduced on the last micro-batch
        if run.optimizer_step(optimizer) and run.step % args.eval_interval == 0:  # [meshrun]
            val_loss = estimate_loss(run, model, val, args.eval_iters)
            if run.is_main:
                print(f"step {run.step}: val loss {val_loss:.4f}")


if __name__ == "__main__":
    main()
