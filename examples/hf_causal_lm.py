"""Train a Hugging Face causal LM under any layout, from pretrained weights or from scratch, and
hand the result back to Hugging Face tools.

The model is a tiny Llama built from a ``LlamaConfig`` here (nothing to download); give
``--init DIR`` (a ``save_pretrained`` directory: config.json + safetensors) to start from its
weights instead: the model is then built on the meta device (no memory) and every rank reads
only the slices its layout gives it. The layout is a choice of overrides, the loop the same:

    meshrun launch --nproc-per-node 2 examples/hf_causal_lm.py --optim.steps=50          # DDP
    meshrun launch --nproc-per-node 2 examples/hf_causal_lm.py --parallel.zero=3         # ZeRO-3
    meshrun launch --nproc-per-node 2 examples/hf_causal_lm.py --parallel.tp=2           # TP
    meshrun launch --nproc-per-node 2 examples/hf_causal_lm.py --parallel.pp=2           # PP
    meshrun launch --nproc-per-node 2 examples/hf_causal_lm.py --parallel.cp=2           # CP
    meshrun launch --nproc-per-node 2 examples/hf_causal_lm.py --init DIR --parallel.zero=3

At the end the run saves a checkpoint (its path is printed); export it as a directory that
``AutoModelForCausalLM.from_pretrained(OUT)`` loads:

    meshrun ckpt export RUN_DIR/checkpoints/step_00000050 OUT --hf [--dtype bf16]

The data is the bytes of Python's own argparse.py, next-byte prediction (vocabulary 256).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

import meshrun
from meshrun.parallel import Pipeline

SEQ = 64


def tiny_llama_config() -> LlamaConfig:
    # 4 layers (2 per stage under PP 2), 4 heads and 2 key/value heads (TP 2 splits both).
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="eager",
        dtype=torch.float32,
    )


def build_model(init: str | None) -> nn.Module:
    if init is None:
        return AutoModelForCausalLM.from_config(tiny_llama_config())  # same seed on every rank
    config = AutoConfig.from_pretrained(init)  # config.json only: no weights are read here
    with torch.device("meta"):  # shapes only: run.load_pretrained allocates each rank's share
        return AutoModelForCausalLM.from_config(config)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Windows(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, data: Tensor) -> None:
        self.data = data

    def __len__(self) -> int:
        return (len(self.data) - 1) // SEQ

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        chunk = self.data[i * SEQ : (i + 1) * SEQ + 1]
        return chunk[:-1], chunk[1:]


def datasets(micro_batch: int, dp: int) -> tuple[Windows, Windows]:
    data = torch.tensor(list(Path(argparse.__file__).read_bytes()), dtype=torch.long)
    split = int(0.9 * len(data))
    # Whole eval batches on every rank: a pipeline's schedule runs chunks of one shape.
    val_len = (len(data) - split) // SEQ // (micro_batch * dp) * (micro_batch * dp) * SEQ
    return Windows(data[:split]), Windows(data[split : split + val_len + 1])


@meshrun.main
def main() -> None:
    run = meshrun.init()  # takes its --section.key=value flags out of sys.argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", default=None, help="a save_pretrained directory to start from")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    pipelined = run.config.parallel.pp > 1

    model: nn.Module | Pipeline = build_model(args.init)
    # Under PP each rank holds its stages only and the schedule runs them (and lm_loss).
    model = run.pipeline(model, lm_loss) if pipelined else run.parallelize(model)
    if args.init:
        run.load_pretrained(model, args.init)  # every rank, only its own slices

    def eval_loss(m: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        with run.loss_parallel():  # a no-op unless parallel.loss_parallel = true
            return lm_loss(m(batch[0]).logits, batch[1])

    opt = run.optimizer(model, torch.optim.AdamW, lr=run.scaled_lr(args.lr), weight_decay=0.0)
    run.lr_scheduler(opt)
    train, val = datasets(run.config.data.micro_batch, run.dp_size)
    loader = run.dataloader(train)
    run.resume(model, opt, loader)
    # On every rank, whatever the layout; a Pipeline computes the loss it was given.
    val_loss = None if pipelined else eval_loss
    start = run.evaluate(model, run.dataloader(val, mode="eval"), val_loss)
    for x, y in run.steps(loader):
        if isinstance(model, Pipeline):  # forward + backward of the micro-batch, stage by stage
            run.pipeline_step(model, x, y)
        else:
            with run.loss_parallel():
                loss = lm_loss(model(x).logits, y)
            run.backward(loss)
        run.optimizer_step(opt)
    end = run.evaluate(model, run.dataloader(val, mode="eval"), val_loss)
    path = run.save_checkpoint()  # export: meshrun ckpt export PATH OUT --hf
    if run.is_main:
        print(f"val loss {start:.6f} -> {end:.6f} after {run.step} steps; checkpoint {path}")


if __name__ == "__main__":
    main()
