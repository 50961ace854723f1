"""Shape 3 of docs/porting.md: a Trainer class that owns the loop (the shape of minGPT's
``mingpt/trainer.py`` with ``projects/chargpt``): a config tree set by dotted flags
(``--trainer.max_iters=4``, parsed by the script itself), callbacks on each batch end, the
optimizer's parameter groups chosen by module name, ``iter_num`` and ``max_iters``. Ported to
meshrun; the doc's diff is taken from this file. It prints what it ran with as JSON.
Lines marked ``fmt: skip`` keep the layout the doc's diff quotes (the user's script as
written), which the formatter would change."""

import ast
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import meshrun


class Node:
    """A tree of settings; ``--a.b=value`` flags set its leaves (as minGPT's CfgNode does)."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)

    def merge_from_args(self, args: list[str]) -> None:
        for arg in args:
            key, _, text = arg.removeprefix("--").partition("=")
            *path, leaf = key.split(".")
            obj = self
            for name in path:
                obj = getattr(obj, name)
            if not hasattr(obj, leaf):
                raise SystemExit(f"unknown setting --{key}")
            try:
                value = ast.literal_eval(text)
            except ValueError:
                value = text
            setattr(obj, leaf, value)


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lm_head(self.block(self.wte(x)))
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self, config: Node) -> list[dict[str, Any]]:
        decay = {f"{mn}.{pn}" if mn else pn for mn, m in self.named_modules()
                 for pn, _ in m.named_parameters(recurse=False)
                 if pn == "weight" and isinstance(m, nn.Linear)}  # fmt: skip
        params = dict(self.named_parameters())
        return [
            {"params": [params[n] for n in sorted(decay)], "weight_decay": config.weight_decay},
            {"params": [p for n, p in params.items() if n not in decay], "weight_decay": 0.0},
        ]


class Trainer:
    def __init__(self, config: Node, run: meshrun.Run, model: nn.Module, train: Any) -> None:
        self.config, self.run, self.model, self.train_dataset = config, run, model, train
        self.callbacks: dict[str, list[Callable[[Trainer], None]]] = {}
        self.iter_num, self.loss = 0, torch.zeros(())

    def add_callback(self, onevent: str, callback: Callable[["Trainer"], None]) -> None:
        self.callbacks.setdefault(onevent, []).append(callback)

    def trigger_callbacks(self, onevent: str) -> None:
        for callback in self.callbacks.get(onevent, []):
            callback(self)

    def run_loop(self) -> None:
        run, config = self.run, self.config
        groups = run.unwrap(self.model).configure_optimizers(config)
        lr = config.learning_rate
        self.optimizer = run.optimizer(self.model, torch.optim.AdamW, groups, lr=lr)
        loader = run.dataloader(self.train_dataset)
        run.resume(self.model, self.optimizer, loader)
        for x, y in run.steps(loader, steps=config.max_iters):
            _, self.loss = self.model(x, y)
            run.backward(self.loss)
            if run.optimizer_step(self.optimizer):
                self.iter_num = run.step
                self.trigger_callbacks("on_batch_end")


def main() -> None:
    config = Node(trainer=Node(learning_rate=5e-4, weight_decay=0.1, max_iters=6),
                  model=Node(width=16))  # fmt: skip
    run = meshrun.init()  # takes --section.key=value flags and the `--` out of sys.argv
    config.merge_from_args(sys.argv[1:])  # the flags after the `--`: --trainer.max_iters=4 ...
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (64, 9), generator=g)
    model = run.parallelize(TinyGPT(width=config.model.width))
    trainer = Trainer(config.trainer, run, model, TensorDataset(ids[:, :-1], ids[:, 1:]))
    seen: list[int] = []

    def batch_end_callback(t: Trainer) -> None:
        seen.append(t.iter_num)

    trainer.add_callback("on_batch_end", batch_end_callback)
    trainer.run_loop()
    if run.is_main:
        print(json.dumps({"iters": seen, "max_iters": config.trainer.max_iters,
                          "width": config.model.width, "lr": run.config.optim.lr}))  # fmt: skip


if __name__ == "__main__":
    meshrun.main(main)()
