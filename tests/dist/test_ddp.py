"""DDP through meshrun on Gloo, in real processes: N ranks train exactly like one process with
the global batch, gradient accumulation all-reduces only on boundary micro-steps, and the logged
loss is the mean over the whole global batch.

The reference runs in the test process itself, with no process group. It sees the same samples
per optimizer step: meshrun's sampler order depends only on the seed and the epoch, so a
one-rank ``ResumableSampler`` with batch G yields, step by step, the set of samples that the N
ranks share out. Every spawn uses the same global batch G = 16, so one reference serves all.
"""

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import GradBucket, ProcessGroup
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import meshrun
from _dist import run_distributed

GLOBAL_BATCH = 16
STEPS = 5
TOL = 1e-5

Batch = dict[str, torch.Tensor]
Params = dict[str, torch.Tensor]


class Regression(Dataset[Batch]):
    """256 fixed samples: x in R^16, y = a fixed smooth function of x plus noise, in R^4."""

    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        w = torch.randn(16, 4, generator=g) / 4
        self.y = torch.tanh(self.x @ w) + 0.1 * torch.randn(n, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Batch:
        return {"x": self.x[i], "y": self.y[i]}


def build_model() -> nn.Module:
    # Its own seed: the same weights in every process, whatever the global RNG has seen.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def compute_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def snapshot(model: nn.Module) -> Params:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: Params, b: Params) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def make_config(run_dir: Path, micro_batch: int) -> meshrun.Config:
    cfg = meshrun.Config()
    cfg.job.run_dir = str(run_dir)
    cfg.job.device = "cpu"
    cfg.job.timeout_s = 60.0
    cfg.data.global_batch = GLOBAL_BATCH
    cfg.data.micro_batch = micro_batch
    cfg.optim.steps = STEPS
    cfg.optim.lr = 0.1
    cfg.metrics.progress = False
    return cfg


class AllReduceCounter:
    """A DDP comm hook that counts its calls (one per bucket per synchronised backward), then
    does DDP's default all-reduce. (DDP checks the hook's annotations at runtime, so this
    module does not use ``from __future__ import annotations``.)"""

    def __init__(self, model: DDP) -> None:
        self.calls = 0
        model.register_comm_hook(model.process_group, self.hook)

    def hook(self, group: ProcessGroup, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        self.calls += 1
        return default_hooks.allreduce_hook(group, bucket)


def measure_buckets(group: ProcessGroup) -> int:
    """All-reduces per synchronised backward of this model (its bucket count), from a plain DDP
    copy trained without accumulation, outside meshrun's loop."""
    probe = DDP(build_model(), process_group=group)
    counter = AllReduceCounter(probe)
    ds = Regression()
    batch = {"x": ds.x[:4], "y": ds.y[:4]}
    per_backward = []
    for _ in range(2):  # the second backward runs on DDP's rebuilt buckets
        before = counter.calls
        compute_loss(probe, batch).backward()
        per_backward.append(counter.calls - before)
    assert per_backward[0] == per_backward[1] >= 1, per_backward
    return per_backward[0]


def train_ddp(rank: int, world_size: int, cfg: meshrun.Config) -> dict[str, Any]:
    """The user's loop under meshrun; runs in each spawned rank."""
    run = meshrun.init(cfg, argv=[])
    assert run.mesh is not None
    buckets = measure_buckets(run.mesh.get_group("dp"))
    model = run.parallelize(build_model())
    assert isinstance(model, DDP), type(model)
    counter = AllReduceCounter(model)
    optimizer = build_optimizer(model, run.scaled_lr())
    for batch in run.steps(run.dataloader(Regression())):
        run.backward(compute_loss(model, batch))
        run.optimizer_step(optimizer)
    result = {
        "params": snapshot(model.module),
        "accum": run.accum,
        "steps": run.step,
        "buckets": buckets,
        "all_reduces": counter.calls,
    }
    run.close()
    return result


@pytest.fixture(scope="module")
def reference() -> tuple[Params, Params, list[float]]:
    """One process, batch G, no process group: initial params, final params, per-step losses."""
    ds = Regression()
    sampler = meshrun.ResumableSampler(
        len(ds), rank=0, world_size=1, global_batch=GLOBAL_BATCH, seed=meshrun.Config().job.seed
    )
    loader = DataLoader(ds, batch_size=GLOBAL_BATCH, sampler=sampler)
    model = build_model()
    initial = snapshot(model)
    optimizer = build_optimizer(model, lr=0.1)
    losses = []
    for batch in itertools.islice(loader, STEPS):
        loss = compute_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses  # it trains: equal parameters are not trivially equal
    assert max_abs_diff(snapshot(model), initial) > 1e-2
    return initial, snapshot(model), losses


def logged_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return [r["loss"] for r in steps]


def check_against_reference(
    results: list[dict[str, Any]], reference: tuple[Params, Params, list[float]], accum: int
) -> None:
    _, final, _ = reference
    for rank, r in enumerate(results):
        assert (r["accum"], r["steps"]) == (accum, STEPS), f"rank {rank}"
        diff = max_abs_diff(r["params"], final)
        assert diff <= TOL, f"rank {rank}: max |param - reference| = {diff:.3g}"


@pytest.mark.timeout(120)
# heavy: [4]; [2] stays (DDP against one process with the global batch)
@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_ddp_equals_one_process_with_the_global_batch(
    world_size: int, reference: tuple[Params, Params, list[float]], tmp_path: Path
) -> None:
    cfg = make_config(tmp_path / "run", micro_batch=GLOBAL_BATCH // world_size)
    results = run_distributed(train_ddp, world_size, cfg, timeout=90)
    check_against_reference(results, reference, accum=1)
    assert logged_losses(tmp_path / "run") == pytest.approx(reference[2], abs=TOL)
    for r in results:  # without accumulation, every backward synchronises
        assert r["all_reduces"] == STEPS * r["buckets"]


@pytest.mark.timeout(90)
def test_accumulation_equals_one_process_and_logs_the_global_mean_loss(
    reference: tuple[Params, Params, list[float]], tmp_path: Path
) -> None:
    # 2 ranks x micro-batch 4 x accumulation 2 = the reference's batch of 16.
    cfg = make_config(tmp_path / "run", micro_batch=4)
    results = run_distributed(train_ddp, 2, cfg, timeout=60)
    check_against_reference(results, reference, accum=2)
    # Step s's logged loss is the loss before step s over the whole global batch s.
    logged = logged_losses(tmp_path / "run")
    assert logged == pytest.approx(reference[2], abs=TOL)


@pytest.mark.timeout(90)
def test_no_sync_all_reduces_once_per_optimizer_step(
    reference: tuple[Params, Params, list[float]], tmp_path: Path
) -> None:
    # 2 ranks x micro-batch 2 x accumulation 4: 20 micro-steps, 5 of them on a boundary.
    cfg = make_config(tmp_path / "run", micro_batch=2)
    results = run_distributed(train_ddp, 2, cfg, timeout=60)
    check_against_reference(results, reference, accum=4)
    for rank, r in enumerate(results):
        assert r["buckets"] == 1, f"rank {rank}: the tiny model should fit one 25 MB bucket"
        assert r["all_reduces"] == STEPS * r["buckets"], (
            f"rank {rank}: {r['all_reduces']} all-reduces for {STEPS} steps x {r['buckets']} "
            f"bucket(s); {STEPS * 4 * r['buckets']} would mean no_sync was not applied"
        )
    assert logged_losses(tmp_path / "run") == pytest.approx(reference[2], abs=TOL)
