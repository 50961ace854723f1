"""A small classifier trained the way users write one, for `meshrun compare`'s test
(tests/e2e/test_compare_cli.py): its own flags, its own model, cross-entropy over the batch.

    meshrun compare --nproc 2 --steps 3 --layout zero=3 compare_classifier.py
    meshrun compare ... compare_classifier.py --reduction sum   # a loss that depends on the
                                                                # micro-batch: differs at step 1
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import meshrun


class Classifier(nn.Module):
    def __init__(self, features: int = 16, hidden: int = 32, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.block = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(torch.relu(self.embed(x))))


@meshrun.main
def main() -> None:
    run = meshrun.init()  # takes its --section.key=value flags out of sys.argv first
    p = argparse.ArgumentParser()
    p.add_argument("--reduction", default="mean", choices=["mean", "sum"])
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 0).long()) % 4
    model = run.parallelize(Classifier())
    opt = run.optimizer(model, torch.optim.AdamW, lr=run.scaled_lr(1e-2))
    for inputs, targets in run.steps(run.dataloader(TensorDataset(x, y))):
        loss = F.cross_entropy(model(inputs), targets, reduction=args.reduction)
        run.backward(loss)
        run.optimizer_step(opt)


if __name__ == "__main__":
    main()
