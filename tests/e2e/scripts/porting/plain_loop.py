"""Shape 1 of docs/porting.md: a plain loop with its own argparse (the shape of pytorch/examples'
word_language_model): epochs, its own StepLR, gradient clipping, a print every few batches, an
evaluation per epoch. Ported to meshrun; the doc's diff is taken from this file."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import meshrun


class CharLSTM(nn.Module):
    def __init__(self, vocab: int = 32, hidden: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.rnn = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(x))[0])


def windows(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (n, 9), generator=g)
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def lm_loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def main() -> None:
    run = meshrun.init()  # first: it takes its --section.key=value flags out of sys.argv
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--log-interval", type=int, default=2)
    args = parser.parse_args()

    train, val = windows(64, 0), windows(16, 1)
    model = run.parallelize(CharLSTM())
    opt = run.optimizer(model, torch.optim.SGD, lr=args.lr)
    steps_per_epoch = len(train) // run.config.data.global_batch
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=steps_per_epoch, gamma=0.5)
    loader = run.dataloader(train)
    run.resume(model, opt, loader, sched=sched)
    for batch in run.steps(loader, steps=args.epochs * steps_per_epoch):
        run.backward(lm_loss(model, batch))
        if run.optimizer_step(opt):
            sched.step()
            if run.is_main and run.step % args.log_interval == 0:
                print(f"step {run.step} lr {sched.get_last_lr()[0]:.4f}")
            if run.step % steps_per_epoch == 0:
                val_loss = run.evaluate(model, run.dataloader(val, mode="eval"), lm_loss)
                if run.is_main:
                    print(f"epoch {run.step // steps_per_epoch} val {val_loss:.4f}")
    run.save_checkpoint()


if __name__ == "__main__":
    meshrun.main(main)()
