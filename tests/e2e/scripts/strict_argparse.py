"""A script with its own strict parser (``parse_args()``, no ``parse_known_args``), called after
``meshrun.init()``: meshrun's ``--section.key=value`` overrides must not reach it. It also
checks ``run.evaluate`` and ``run.unwrap`` on one process and prints what it saw as JSON."""

import argparse
import json
import sys

import torch
from torch import nn

import meshrun

run = meshrun.init()
argv_after_init = list(sys.argv[1:])
parser = argparse.ArgumentParser()
parser.add_argument("--eval-batches", type=int, required=True)
parser.add_argument("--tag", default="")
args = parser.parse_args()  # strict: an unknown --optim.steps=... would exit 2 here

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
net[2].eval()  # a submodule the user keeps in eval mode: evaluate must give it back so
model = run.parallelize(net)
xs = [torch.randn(n, 4) for n in (3, 5, 2)][: args.eval_batches]
batches = [(x, x.sum(1, keepdim=True)) for x in xs]


def mse(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(m(batch[0]), batch[1])


loss = run.evaluate(model, batches, mse)
with torch.no_grad():
    net.eval()
    expected = sum(float(mse(net, b)) * b[0].shape[0] for b in batches) / sum(len(x) for x in xs)
    net.train()
    net[2].eval()
print(
    json.dumps(
        {
            "argv": argv_after_init,
            "args": vars(args),
            "steps": run.config.optim.steps,
            "lr": run.config.optim.lr,
            "loss": loss,
            "expected": expected,
            "modes": [m.training for m in net.modules()],
            "unwrap_is_net": run.unwrap(torch.compile(model)) is net,
        }
    )
)
run.close()
