"""A one-process loop with gradient accumulation (global_batch 8 = 4 micro-batches of 2) that
evaluates after step 2 with a loss function sleeping ``EVAL_SLEEP_S``: it prints, per micro-step,
``run.step`` and ``run.is_step_end`` after ``run.optimizer_step``, as one JSON line."""

import json
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import meshrun

EVAL_SLEEP_S = float(sys.argv[1])
run = meshrun.init(
    argv=["--data.global_batch=8", "--data.micro_batch=2", "--optim.steps=3", *sys.argv[2:]]
)
torch.manual_seed(0)
model = run.parallelize(nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
loader = run.dataloader(data)


def slow_mse(m: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    time.sleep(EVAL_SLEEP_S)
    return nn.functional.mse_loss(m(batch[0]), batch[1])


seen = []
for x, y in run.steps(loader):
    run.backward(nn.functional.mse_loss(model(x), y))
    run.optimizer_step(opt)
    seen.append([run.step, run.is_step_end])
    if run.is_step_end and run.step == 2:
        run.evaluate(model, [(x, y)], slow_mse)
print(json.dumps({"seen": seen, "accum": run.accum}), flush=True)
run.close()
