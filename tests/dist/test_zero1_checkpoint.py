"""A checkpoint under parallel.zero=1 (ZeroRedundancyOptimizer) is refused with a clear error on
every rank, not written half-right: DCP's get_state_dict does not consolidate its state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import meshrun
from _dist import run_distributed


def save_under_zero1(rank: int, world: int, run_dir: str) -> str:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.timeout_s, cfg.metrics.progress = run_dir, 60.0, False
    cfg.data.global_batch, cfg.data.micro_batch, cfg.optim.steps = 8, 4, 1
    cfg.parallel.zero = 1
    run = meshrun.init(cfg, argv=[])
    model = run.parallelize(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)))
    opt = run.optimizer(model, torch.optim.SGD, lr=0.1)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    for x, y in run.steps(run.dataloader(data)):
        run.backward(nn.functional.mse_loss(model(x), y))
        run.optimizer_step(opt)
    try:
        run.save_checkpoint()
        message = "saved"
    except meshrun.checkpoint.CheckpointError as e:
        message = str(e)
    run.close()
    return message


@pytest.mark.timeout(120)
def test_zero1_checkpoint_is_refused_clearly_on_every_rank(tmp_path: Path) -> None:
    messages = run_distributed(save_under_zero1, 2, str(tmp_path), timeout=90)
    for m in messages:
        assert "parallel.zero=1" in m and "not supported yet" in m, m
    assert not list((tmp_path / "checkpoints").glob("step_*"))
