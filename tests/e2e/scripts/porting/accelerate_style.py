"""Shape 2 of docs/porting.md: a script written for Hugging Face Accelerate (the shape of
transformers' run_clm_no_trainer.py): a transformers model called with dict batches, its own
parameter groups and linear schedule, accumulation, evaluation as a perplexity, a checkpoint
every N steps and save_pretrained at the end. Ported to meshrun; the doc's diff is taken from
this file. Lines marked ``fmt: skip`` keep the layout the doc's diff quotes (the user's script
as written), which the formatter would change."""

import argparse
import math
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

import meshrun


class Blocks(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([s["input_ids"] for s in samples])
    return {"input_ids": ids, "labels": ids.clone()}


def clm_loss(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return model(**batch).loss


def main() -> None:
    run = meshrun.init()
    parser = argparse.ArgumentParser()
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    args = parser.parse_args()

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    torch.manual_seed(0)
    model = run.parallelize(LlamaForCausalLM(config))
    no_decay = ("bias", "norm.weight")
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not n.endswith(no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n.endswith(no_decay)], "weight_decay": 0.0},
    ]  # fmt: skip
    optimizer = run.optimizer(model, torch.optim.AdamW, groups, lr=args.learning_rate)
    lr_scheduler = get_scheduler("linear", optimizer, num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=run.config.optim.steps)  # fmt: skip
    train_dataloader = run.dataloader(Blocks(64, 0), collate_fn=collate)
    run.resume(model, optimizer, train_dataloader, lr_scheduler=lr_scheduler)
    for batch in run.steps(train_dataloader):
        run.backward(clm_loss(model, batch))
        if run.optimizer_step(optimizer):
            lr_scheduler.step()
    eval_dataloader = run.dataloader(Blocks(16, 1), mode="eval", collate_fn=collate)
    eval_loss = run.evaluate(model, eval_dataloader, clm_loss)
    if run.is_main:
        print(f"step {run.step}: perplexity {math.exp(eval_loss):.3f}")
    run.save_checkpoint()  # then: meshrun ckpt export RUN_DIR/checkpoints/step_N OUT --hf


if __name__ == "__main__":
    meshrun.main(main)()
