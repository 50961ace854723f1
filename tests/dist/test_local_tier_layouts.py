"""The node-local checkpoint tier under sharded layouts, in real Gloo processes (2 ranks, each
its own simulated node: ``checkpoint.local_ranks_per_node = 1``, ``local_dir`` per ``{node}``).

A ZeRO-3 (FSDP2, DTensor shards) run of 6 steps takes node-local snapshots every 2 steps and
no shared checkpoint. Then the same run again, after its newest snapshot (step 6) was deleted
everywhere and node 1's directory wiped: it restores step 4 from the local tier, rank 1's shard
from the replica node 0 kept, trains steps 5-6 and ends with parameters bitwise equal to the
first run's. The same on 1 rank finds only a 2-rank history and starts fresh, saying why.
The e2e side (SIGKILL, torchrun restarts, per-step losses) is tests/e2e/test_resume_chaos.py.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import meshrun
from _dist import run_distributed

STEPS = 6


def build_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 8, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(8, 2, generator=g))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def make_config(tmp: Path, zero: int) -> meshrun.Config:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = str(tmp / "run"), "cpu", 60.0
    cfg.data.global_batch, cfg.data.micro_batch = 8, 2
    cfg.optim.steps, cfg.optim.lr, cfg.optim.warmup_steps = STEPS, 0.05, 2
    cfg.metrics.progress = False
    cfg.parallel.zero = zero
    cfg.checkpoint.local_interval = 2
    cfg.checkpoint.local_ranks_per_node = 1
    cfg.checkpoint.local_dir = str(tmp / "local" / "node{node}")
    cfg.checkpoint.local_keep = True  # the second run restores the first run's snapshots
    return cfg


def train(rank: int, world_size: int, cfg: meshrun.Config) -> dict[str, Any]:
    run = meshrun.init(cfg, argv=[])
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: lines.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("meshrun").addHandler(handler)
    model = run.parallelize(build_model())
    opt = run.optimizer(model, torch.optim.AdamW, lr=run.scaled_lr())  # ZeRO-1's when zero=1
    run.lr_scheduler(opt)
    loader = run.dataloader(Data())
    start = run.resume(model, opt, loader)
    for batch in run.steps(loader):
        run.backward(F.mse_loss(model(batch["x"]), batch["y"]))
        run.optimizer_step(opt)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=opts)
    out = {"start": start, "lines": lines, "params": {k: v.clone() for k, v in full.items()}}
    run.close()
    return out


def _history(tmp: Path, node: int) -> Path:
    [hist] = (tmp / "local" / f"node{node}").iterdir()
    return hist


# heavy (CI's time): the local tier restoring from itself and from a peer stays in CI in
# tests/e2e/test_resume_chaos.py
@pytest.mark.heavy
@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero", [3, pytest.param(1, marks=pytest.mark.heavy)])
def test_local_tier_restores_a_sharded_run_and_a_lost_node_from_its_peer(
    tmp_path: Path, zero: int
) -> None:
    cfg = make_config(tmp_path, zero)
    ref = run_distributed(train, 2, cfg, timeout=150)
    assert [r["start"] for r in ref] == [0, 0]
    for node in (0, 1):  # each node holds both shards (its own and its peer's) of steps 4, 6
        steps = sorted(p.name for p in _history(tmp_path, node).iterdir())
        assert steps == ["step_000000004", "step_000000006"]
        shutil.rmtree(_history(tmp_path, node) / "step_000000006")
    shutil.rmtree(_history(tmp_path, 1))  # node 1 replaced: its local storage is empty
    got = run_distributed(train, 2, cfg, timeout=150)
    assert [r["start"] for r in got] == [4, 4]
    said = [line for line in got[0]["lines"] if "restored from" in line]
    assert len(said) == 1 and "node-local tier: step 4 (1 rank(s) [1] from a peer" in said[0]
    for k, v in ref[0]["params"].items():
        assert torch.equal(got[0]["params"][k], v), f"{k} differs after the local restore"
    assert (_history(tmp_path, 1) / "step_000000004" / "rank_00001.pt").is_file()
    if zero != 3:
        return
    cfg.parallel.zero = 0  # 1 rank (nothing to shard over): the 2-rank snapshots don't fit
    one = run_distributed(train, 1, cfg, timeout=150)
    assert one[0]["start"] == 0
    assert any(
        "node-local tier not used" in line and "world of 2 ranks, this run has 1" in line
        for line in one[0]["lines"]
    ), one[0]["lines"]
