"""ZeRO-1 (``parallel.zero=1``, ZeroRedundancyOptimizer) checkpoints, on Gloo in real processes.

One 2-rank world trains 6 steps straight (an async save at step 3, each rank writing only the AdamW
state of the parameters it owns); a second 2-rank world resumes the step-3 checkpoint and
trains to step 6: its final parameters must be bitwise those of the straight run.
A 1-rank run (``zero=0``, a plain AdamW) resumes the same checkpoint and must land
within float tolerance (its accumulation is 2x longer, so sums round differently).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import meshrun
from _dist import run_distributed
from meshrun.checkpoint import on_disk

STEPS, SAVE_AT = 6, 3


def build_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 1))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def train(
    root: Path, resume: str, interval: int, zero: int = 1, async_: bool = False
) -> dict[str, Any]:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = str(root / "run"), "cpu", 60.0
    cfg.metrics.progress = False
    cfg.data.global_batch, cfg.data.micro_batch = 8, 2
    cfg.optim.steps = STEPS
    cfg.parallel.zero = zero
    cfg.checkpoint.dir, cfg.checkpoint.resume = str(root / "ckpt"), resume
    cfg.checkpoint.interval, cfg.checkpoint.keep_last = interval, 10
    cfg.checkpoint.async_ = async_
    run = meshrun.init(cfg, argv=[])
    model = run.parallelize(build_model())
    opt = run.optimizer(model, torch.optim.AdamW, lr=0.02)
    loader = run.dataloader(data())
    start = run.resume(model, opt, loader)
    for x, y in run.steps(loader):
        run.backward(F.mse_loss(model(x), y))
        run.optimizer_step(opt)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    kind = type(opt).__name__
    run.close()
    return {"start": start, "params": params, "optimizer": kind}


def straight(rank: int, world: int, root: str) -> dict[str, Any]:
    out = train(Path(root), resume="never", interval=SAVE_AT, async_=True)
    meta = dcp.FileSystemReader(str(on_disk.step_dir(Path(root) / "ckpt", SAVE_AT))).read_metadata()
    out["owners"] = {  # which shard files hold each optimizer tensor
        k: {meta.storage_data[i].relative_path for i in meta.storage_data if i.fqn == k}
        for k in meta.state_dict_metadata
        if k.startswith("optim.state.")
    }
    return out


def resumed(rank: int, world: int, root: str, zero: int = 1) -> dict[str, Any]:
    path = on_disk.step_dir(Path(root) / "ckpt", SAVE_AT)
    return train(Path(root), resume=str(path), interval=0, zero=zero)


def plain(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v for k, v in params.items()}  # DDP's prefix


@pytest.mark.timeout(240)
def test_zero1_save_resume_bitwise_and_on_one_rank(tmp_path: Path) -> None:
    ref = run_distributed(straight, 2, str(tmp_path), timeout=150)
    assert ref[0]["optimizer"] == "ZeroRedundancyOptimizer"
    owners = ref[0]["owners"]
    # 6 params x (exp_avg, exp_avg_sq, step), each written once, by its owner's file
    assert len(owners) == 18 and all(len(files) == 1 for files in owners.values()), owners
    assert {f.split("_")[2] for files in owners.values() for f in files} == {"0", "1"}, owners
    again = run_distributed(resumed, 2, str(tmp_path), timeout=150)
    for before, after in zip(ref, again, strict=True):
        assert after["start"] == SAVE_AT and after["optimizer"] == "ZeroRedundancyOptimizer"
        for k, v in before["params"].items():
            assert torch.equal(v, after["params"][k]), f"{k} differs after resume"
    (single,) = run_distributed(resumed, 1, str(tmp_path), 0, timeout=120)
    assert single["start"] == SAVE_AT and single["optimizer"] == "AdamW"
    want, got = plain(ref[0]["params"]), plain(single["params"])
    diff = max((got[k] - v).abs().max().item() for k, v in want.items())
    print(f"ZeRO-1 x2 -> 1 rank: max |param diff| vs the straight run {diff:.2e}")
    assert diff < 1e-5
