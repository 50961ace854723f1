"""A small transformer written the way users write one, with the three shapes that once trained
something else than one process without a word (docs/porting.md, "Checking your port"):

- built on the meta device, with an ``init_weights()`` that calls each layer's
  ``reset_parameters()`` (every rank once drew its shard from the same seed under ZeRO-3);
- evaluated under ``torch.no_grad()`` before training (ZeRO-3's root unit stayed unsharded and
  the optimizer held parameters the model no longer used);
- attention with ``wq/wk/wv/wo`` and a reshape to heads (``--heads global`` reshapes by the
  global head count: refused under TP before step 1; ``-1``, the default, runs on a TP shard).

    meshrun compare --nproc 2 --steps 3 --layout zero=3 --layout tp=2 compare_transformer.py
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import meshrun

VOCAB, DIM, HEADS, SEQ = 64, 32, 4, 16


class Attention(nn.Module):
    def __init__(self, global_heads: bool) -> None:
        super().__init__()
        self.wq, self.wk = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.wv, self.wo = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.global_heads = global_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads = HEADS if self.global_heads else -1
        q, k, v = (
            w(x).view(b, s, heads, DIM // HEADS).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, global_heads: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention(global_heads)
        self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.w2(F.gelu(self.w1(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, global_heads: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(global_heads) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
                module.reset_parameters()


@meshrun.main
def main() -> None:
    run = meshrun.init()  # takes its --section.key=value flags out of sys.argv first
    p = argparse.ArgumentParser()
    p.add_argument("--heads", default="-1", choices=["-1", "global"])
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (256, SEQ + 1), generator=g)
    with torch.device("meta"):
        model = TinyLM(global_heads=args.heads == "global")
    model = run.parallelize(model)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    with torch.no_grad():  # evaluated before training, as fine-tuning scripts do
        x, y = next(iter(run.dataloader(data)))
        first = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    run.log.info(f"loss before training: {first.item():.4f}")
    opt = run.optimizer(model, torch.optim.AdamW, lr=run.scaled_lr(3e-3))
    for inputs, targets in run.steps(run.dataloader(data)):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        run.backward(loss)
        run.optimizer_step(opt)


if __name__ == "__main__":
    main()
