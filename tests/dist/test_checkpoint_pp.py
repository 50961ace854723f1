"""Pipeline-parallel checkpoints (``run.pipeline``, pp = 2, 1F1B), on Gloo in real processes.

A 2-rank pipeline trains 4 steps straight, saving at step 2 (each rank writes its own stages'
parameters and AdamW state under the unsplit model's names); a second pipeline resumes the
step-2 checkpoint and trains to step 4: every rank's parameters must be bitwise those of the
straight run. The checkpoint's keys are those of the unsplit model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor

import meshrun
from _dist import run_distributed
from meshrun.checkpoint import on_disk
from meshrun.demo.model import GPT, demo_config

STEPS, SAVE_AT = 4, 2


class Windows(torch.utils.data.Dataset[dict[str, Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, 16, (96, 17), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input": self.tokens[i, :-1], "target": self.tokens[i, 1:]}


def build_model() -> GPT:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return GPT(dataclasses.replace(demo_config("tiny"), n_layer=4))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train(rank: int, world: int, root: str, resume: str, interval: int) -> dict[str, Any]:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = f"{root}/run", "cpu", 60.0
    cfg.metrics.progress = False
    cfg.data.global_batch, cfg.data.micro_batch, cfg.optim.steps = 8, 4, STEPS
    cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.parallel.pp_microbatches = 2, "1f1b", 2
    cfg.checkpoint.dir, cfg.checkpoint.resume = f"{root}/ckpt", resume
    cfg.checkpoint.interval, cfg.checkpoint.keep_last = interval, 10
    run = meshrun.init(cfg, argv=[])
    pipe = run.pipeline(build_model(), lm_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    loader = run.dataloader(Windows())
    start = run.resume(pipe, opt, loader)
    for batch in run.steps(loader):
        run.pipeline_step(pipe, batch["input"], batch["target"])
        run.optimizer_step(opt)
    params = {k: v.detach().clone() for m in pipe.modules for k, v in m.state_dict().items()}
    run.close()
    return {"start": start, "params": params}


@pytest.mark.timeout(240)
def test_pipeline_checkpoint_resumes_bitwise(tmp_path: Path) -> None:
    straight = run_distributed(train, 2, str(tmp_path), "never", SAVE_AT, timeout=150)
    path = on_disk.step_dir(tmp_path / "ckpt", SAVE_AT)
    keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    model_keys = {f"model.{k}" for k in build_model().state_dict()}
    assert model_keys <= keys, sorted(model_keys - keys)[:5]  # the unsplit model's names
    assert any(k.startswith("optim.state.blocks.3.") for k in keys)
    resumed = run_distributed(train, 2, str(tmp_path), str(path), 0, timeout=150)
    for before, after in zip(straight, resumed, strict=True):
        assert after["start"] == SAVE_AT
        assert before["params"].keys() == after["params"].keys()
        for k, v in before["params"].items():
            assert torch.equal(v, after["params"][k]), f"{k} differs after resume"
