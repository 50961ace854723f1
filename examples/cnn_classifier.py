"""An image classifier as vision scripts are written: samples are dicts, a collate function of the
script's own batches them (keeping a non-tensor field), loader worker processes prepare them,
and the network has BatchNorm. meshrun shards the samples over the ranks in a resumable order,
seeds each worker per (seed, rank, worker), and keeps the loop the script's own.

    meshrun launch --nproc-per-node 2 examples/cnn_classifier.py --optim.steps=60 \\
        --data.num_workers=2 --data.micro_batch=16

The images are made here: noise with one bright square, the label saying which quadrant holds
it. Under DDP (the default) rank 0's BatchNorm statistics are broadcast before each forward, so
every rank evaluates the same network; under ZeRO-2/3 on CPU each rank keeps its own statistics
(meshrun warns at start; ``parallel.sync_batchnorm`` needs CUDA).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

import meshrun

Sample = dict[str, Any]


class Squares(Dataset[Sample]):
    """``n`` 3x16x16 images; label q in 0..3: the quadrant of the bright 4x4 square."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, 3, 16, 16, generator=g) * 0.5
        self.labels = torch.randint(0, 4, (n,), generator=g)
        for i, q in enumerate(self.labels.tolist()):
            r, c = 2 + 8 * (q // 2), 2 + 8 * (q % 2)
            self.images[i, :, r : r + 4, c : c + 4] += 2.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Sample:
        image = self.images[i]
        if torch.rand(()) < 0.5:  # augmentation drawn in the worker (seeded per worker by meshrun)
            image = image + 0.1 * torch.randn_like(image)
        return {"image": image, "label": int(self.labels[i]), "name": f"square-{i}"}


def collate(samples: list[Sample]) -> Sample:
    """The script's own batching (module level, so worker processes can import it)."""
    return {
        "image": torch.stack([s["image"] for s in samples]),
        "label": torch.tensor([s["label"] for s in samples]),
        "names": [s["name"] for s in samples],  # not a tensor: passed through as is
    }


def build_cnn() -> nn.Module:
    def conv(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU())

    return nn.Sequential(
        conv(3, 16),
        nn.MaxPool2d(2),
        conv(16, 32),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4, 4),
    )


def loss_of(model: nn.Module, batch: Sample) -> Tensor:
    return F.cross_entropy(model(batch["image"]), batch["label"])


def error_of(model: nn.Module, batch: Sample) -> Tensor:
    return (model(batch["image"]).argmax(1) != batch["label"]).float().mean()


@meshrun.main
def main() -> None:
    run = meshrun.init()
    train, val = Squares(2048, seed=0), Squares(256, seed=1)
    model = run.parallelize(build_cnn())
    opt = run.optimizer(model, torch.optim.SGD, lr=run.scaled_lr(0.05), momentum=0.9)
    run.lr_scheduler(opt)
    loader = run.dataloader(train, collate_fn=collate)
    run.resume(model, opt, loader)
    for batch in run.steps(loader):
        run.backward(loss_of(model, batch))
        run.optimizer_step(opt)
    # Every rank evaluates its share of the validation set; evaluate sums over the ranks.
    val_loss = run.evaluate(model, run.dataloader(val, mode="eval", collate_fn=collate), loss_of)
    error = run.evaluate(model, run.dataloader(val, mode="eval", collate_fn=collate), error_of)
    if run.is_main:
        print(f"val loss {val_loss:.4f}, val error {error:.1%} after {run.step} steps")


if __name__ == "__main__":
    main()
