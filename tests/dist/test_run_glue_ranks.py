"""``run.optimizer`` with parameter groups and ``run.evaluate`` on 2 real Gloo ranks, against one
process: ZeRO-1 (a ZeroRedundancyOptimizer over nanoGPT-style weight-decay groups, the run's
layout) trains 3 steps like one AdamW on the global batch; groups made before a ZeRO-3
``parallelize`` are refused, groups made after it build; ``run.evaluate`` under DDP and under
ZeRO-3 gives the one-process loss on an eval set that splits unevenly over the ranks (3 batches
on rank 0, 2 on rank 1: without the per-batch agreement the ZeRO-3 forward would wait forever).

Under PP 2 x ZeRO-1 2 (4 ranks) the groups reach ZeRO as the plain aliases it steps, and every
stage parameter trains, equal across the data-parallel replicas.

One spawn serves the 2-rank checks (process starts cost seconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import meshrun
from _dist import run_distributed
from meshrun.config import ConfigError, ParallelConfig
from meshrun.parallel import build_optimizer, parallelize

STEPS, GLOBAL, MICRO, LR = 3, 8, 4, 0.02


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(6, 6), nn.LayerNorm(6)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.norm(self.fc(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.layers:
            x = block(x)
        return self.head(x)


def groups_of(model: nn.Module) -> list[dict[str, Any]]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.5},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(1)
    x, xv = torch.randn(STEPS * GLOBAL, 6, generator=g), torch.randn(9, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True)), TensorDataset(xv, xv.sum(1, keepdim=True))


def mse(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def full(t: Tensor) -> Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def glue(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = run_dir, "cpu", 60.0
    cfg.data.global_batch, cfg.data.micro_batch, cfg.data.shuffle = GLOBAL, MICRO, False
    cfg.optim.steps, cfg.optim.decay, cfg.metrics.progress = STEPS, "constant", False
    cfg.parallel.zero = 1
    run = meshrun.init(cfg, argv=[])
    train, val = data()
    model = run.parallelize(Net())
    out: dict[str, Any] = {"unwrapped": type(run.unwrap(model)).__name__}
    opt = run.optimizer(model, torch.optim.AdamW, groups_of(run.unwrap(model)), lr=LR)
    out["optimizer"] = type(opt).__name__
    out["decay"] = [g["weight_decay"] for g in opt.param_groups]
    for x, y in run.steps(run.dataloader(train)):
        run.backward(F.mse_loss(model(x), y))
        run.optimizer_step(opt)
    out["params"] = {k: full(v) for k, v in run.unwrap(model).state_dict().items()}
    out["eval_ddp"] = run.evaluate(model, run.dataloader(val, 2, mode="eval"), mse)
    out["batches"] = len(run.dataloader(val, 2, mode="eval"))

    zero3 = ParallelConfig(zero=3)
    stale = Net()
    stale_groups = groups_of(stale)  # made before parallelize: FSDP2 replaces the parameters
    sharded = parallelize(stale, run.mesh, zero3, run.device)
    try:
        build_optimizer(sharded, torch.optim.AdamW, run.mesh, zero3, stale_groups, lr=LR)
        out["stale"] = "no error"
    except ConfigError as e:
        out["stale"] = str(e)
    opt3 = build_optimizer(sharded, torch.optim.AdamW, run.mesh, zero3, groups_of(sharded))
    out["zero3_groups"] = [len(g["params"]) for g in opt3.param_groups]
    out["eval_zero3"] = run.evaluate(sharded, run.dataloader(val, 2, mode="eval"), mse)
    out["training_after"] = all(m.training for m in sharded.modules())
    run.close()
    return out


def reference() -> dict[str, Any]:
    """One process: AdamW over the same groups, the whole global batch per step."""
    train, val = data()
    model = Net()
    initial = mse(model, val.tensors).item()
    opt = torch.optim.AdamW(groups_of(model), lr=LR)
    for step in range(STEPS):
        x, y = (
            train.tensors[0][step * GLOBAL : (step + 1) * GLOBAL],
            train.tensors[1][step * GLOBAL : (step + 1) * GLOBAL],
        )
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        trained = mse(model, val.tensors).item()
    return {"params": model.state_dict(), "eval": trained, "initial": initial}


@pytest.mark.timeout(480)  # a hang guard for a loaded machine, not a timing assert
def test_param_groups_and_evaluate_on_two_ranks(tmp_path: Path) -> None:
    outs = run_distributed(glue, 2, str(tmp_path / "run"), timeout=420)
    ref = reference()
    for out in outs:
        assert out["unwrapped"] == "Net" and out["optimizer"] == "ZeroRedundancyOptimizer"
        assert out["decay"] == [0.5, 0.0]
        for name, value in ref["params"].items():
            torch.testing.assert_close(out["params"][name], value, rtol=1e-5, atol=1e-6)
        assert "3 tensor(s) that are not parameters of the parallelized FSDPNet" in out["stale"], (
            out["stale"]
        )
        assert out["zero3_groups"] == [3, 7]
        assert out["eval_ddp"] == pytest.approx(ref["eval"], rel=1e-5)
        assert out["eval_zero3"] == pytest.approx(ref["initial"], rel=1e-5)
        assert out["training_after"] is True
    assert [o["batches"] for o in outs] == [3, 2]  # the uneven shares the agreement covers
    assert outs[0]["eval_ddp"] == outs[1]["eval_ddp"]


def pp_zero1_groups(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """PP 2 x ZeRO-1 2: weight-decay groups of the stage parameters, stepped by ZeRO through
    the plain aliases of Pipeline.local_parameters."""
    import torch.distributed as dist
    from test_layouts import build_model  # the PP x ZeRO-1 tests' model and data
    from test_layouts_pp import N_LAYER, Windows, lm_loss

    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = run_dir, "cpu", 60.0
    cfg.data.global_batch, cfg.data.micro_batch, cfg.optim.steps = 8, 4, 2
    cfg.parallel.pp, cfg.parallel.zero, cfg.metrics.progress = 2, 1, False
    run = meshrun.init(cfg, argv=[])
    pipe = run.pipeline(build_model(n_layer=N_LAYER), lm_loss)
    before = [full(p) for p in pipe.parameters()]
    opt = run.optimizer(pipe, torch.optim.AdamW, groups_of_params(pipe.parameters()), lr=1e-2)
    stepped = [p for g in opt.param_groups for p in g["params"]]
    for batch in run.steps(run.dataloader(Windows())):
        run.pipeline_step(pipe, batch["input"], batch["target"])
        run.optimizer_step(opt)
    after = [full(p) for p in pipe.parameters()]
    mine = torch.cat([p.flatten() for p in after])
    replicas = [torch.zeros_like(mine) for _ in range(run.dp_size)]
    assert run.mesh is not None
    dist.all_gather(replicas, mine, group=run.mesh.get_group("dp"))
    out = {
        "optimizer": type(opt).__name__,
        "decay": [g["weight_decay"] for g in opt.param_groups],
        "aliases": all(hasattr(p, "meshrun_view_of") for p in stepped),
        "plain": not any(isinstance(p, DTensor) for p in stepped),
        "changed": sum(not torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "params": len(after),
        "replicas_equal": all(torch.equal(r, replicas[0]) for r in replicas),
    }
    run.close()
    return out


def groups_of_params(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.5},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


@pytest.mark.heavy  # 4 ranks; ZeRO-1's groups against one process are the 2-rank test
@pytest.mark.timeout(480)  # a hang guard for a loaded machine, not a timing assert
def test_param_groups_under_pp_and_zero1(tmp_path: Path) -> None:
    outs = run_distributed(pp_zero1_groups, 4, str(tmp_path / "run"), timeout=420)
    for out in outs:
        assert out["optimizer"] == "ZeroRedundancyOptimizer" and out["decay"] == [0.5, 0.0]
        assert out["aliases"] and out["plain"], out
        assert out["changed"] == out["params"] > 0, out  # every stage parameter trained
        assert out["replicas_equal"], out
