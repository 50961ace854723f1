"""The user's own state in checkpoints, on 2 Gloo ranks: a scheduler the user steps after
``run.optimizer_step`` is saved at the model's step (and no warning says otherwise), a
replicated object that differs across ranks is named at save time, per-rank objects come back
on their own rank (and are refused on another world size), and torch's RNG (dropout) is one
stream per data-parallel coordinate, shared by the tensor-parallel ranks of one coordinate,
also after a resume on another layout. The kill-and-resume run of all of it through
``meshrun launch`` is tests/e2e/test_user_state_resume.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshrun
from _dist import run_distributed
from meshrun.checkpoint import CheckpointError, on_disk

STEPS = 4


class Box:
    """A user object with a tensor and a number (registered by name or per rank)."""

    def __init__(self, value: float) -> None:
        self.t = torch.full((2, 3), value)
        self.n = int(value)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t, self.n = state["t"].clone(), state["n"]


def make_config(
    run_dir: Path, resume: str = "auto", tp: int = 1, steps: int = STEPS
) -> meshrun.Config:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = str(run_dir), "cpu", 60.0
    cfg.data.global_batch, cfg.data.micro_batch = 4, 2
    cfg.optim.steps = steps
    cfg.metrics.progress = False
    cfg.checkpoint.interval, cfg.checkpoint.resume = 2, resume
    cfg.checkpoint.on_error = "stop"
    cfg.parallel.tp = tp
    return cfg


def start(cfg: meshrun.Config) -> tuple[Any, nn.Module, torch.optim.Optimizer, Any, list[str]]:
    run = meshrun.init(cfg, argv=[])
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: warnings.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("meshrun").addHandler(handler)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = nn.Linear(4, 1)  # replicated on every rank: no layout needed here
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = run.dataloader(torch.randn(32, 4, generator=torch.Generator().manual_seed(1)))
    return run, model, opt, loader, warnings


def train(
    run: Any,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    loader: Any,
    sched: Any = None,
    each: Any = None,
) -> list[float]:
    """The user's loop; returns the LR of every step (each(): after the user's own step)."""
    lrs = []
    for batch in run.steps(loader):
        run.backward(model(batch).pow(2).mean())
        lrs.append(opt.param_groups[0]["lr"])
        run.optimizer_step(opt)
        if sched is not None:
            sched.step()  # the user's own scheduler, after run.optimizer_step
        if each is not None:
            each()
    return lrs


def user_scheduler(rank: int, world: int, run_dir: Path) -> dict[str, Any]:
    run, model, opt, loader, warnings = start(make_config(run_dir))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    run.resume(model, opt, loader, sched=sched)
    train(run, model, opt, loader, sched)
    run.close()
    return {"last_epoch": sched.last_epoch, "warnings": warnings}


@pytest.mark.timeout(120)
def test_user_scheduler_is_saved_at_the_step_of_the_model(tmp_path: Path) -> None:
    """Before: the checkpoint of step 2 held the scheduler at 1 (saved inside optimizer_step,
    before the user's sched.step()), and each save warned the scheduler was not saved."""
    results = run_distributed(user_scheduler, 2, tmp_path)
    for step in (2, 4):
        saved = json.loads(
            (on_disk.step_dir(tmp_path / "checkpoints", step) / "state.json").read_text()
        )
        assert saved["plain"]["user"]["sched"]["last_epoch"] == step
    assert results[0]["last_epoch"] == STEPS
    assert not [w for w in results[0]["warnings"] if "LR scheduler" in w], results[0]["warnings"]


def differing_replicated(rank: int, world: int, run_dir: Path) -> str:
    run, model, opt, loader, _ = start(make_config(run_dir))
    run.resume(model, opt, loader, stats=Box(float(rank)), same=Box(1.0))
    try:
        run.save_checkpoint()
    except CheckpointError as e:
        return str(e)
    finally:
        run.close(failed=True)
    return "saved"


@pytest.mark.timeout(120)
def test_replicated_object_that_differs_across_ranks_is_named_at_save(tmp_path: Path) -> None:
    """Before: saved (one copy), and every rank resumed with it."""
    errors = run_distributed(differing_replicated, 2, tmp_path)
    for e in errors:
        assert "'stats' differs between rank 0 and rank(s) [1]" in e, e
        assert "'same'" not in e and "per_rank=" in e, e


def per_rank_run(rank: int, world: int, run_dir: Path, steps: int) -> dict[str, Any]:
    run, model, opt, loader, _ = start(make_config(run_dir, steps=steps))
    box = Box(-1.0)
    try:
        at = run.resume(model, opt, loader, per_rank={"hidden": box})
    except CheckpointError as e:
        run.close(failed=True)
        return {"error": str(e)}
    restored = (box.t.clone(), box.n)

    def carry() -> None:  # each rank's own state, moved every step
        box.t += rank + 1
        box.n += 10 * (rank + 1)

    train(run, model, opt, loader, each=carry)
    run.close()
    return {"at": at, "restored": restored, "final": (box.t, box.n)}


@pytest.mark.timeout(180)
def test_per_rank_objects_come_back_on_their_rank_and_refused_on_another_world(
    tmp_path: Path,
) -> None:
    """Before: run.resume had no per_rank= (and an object by name came back as one rank's
    copy on every rank)."""
    first = run_distributed(per_rank_run, 2, tmp_path, 2)
    second = run_distributed(per_rank_run, 2, tmp_path, STEPS)
    for rank in (0, 1):
        assert second[rank]["at"] == 2
        t, n = second[rank]["restored"]
        assert torch.equal(t, first[rank]["final"][0]) and n == first[rank]["final"][1]
        assert n == -1 + 2 * 10 * (rank + 1)  # this rank's own, not the other's
    [one] = run_distributed(per_rank_run, 1, tmp_path, STEPS + 2)
    assert (
        "saved on 2 ranks (dp 2), this run has 1 (dp 1): per-rank objects ['hidden']"
        in one["error"]
    )


def draws(rank: int, world: int, run_dir: Path, tp: int, resume: str) -> dict[str, Any]:
    """torch's draw at the first micro-batch (what dropout would use), after a resume."""
    run, model, opt, loader, _ = start(make_config(run_dir, resume, tp, STEPS + 2))
    at = run.resume(model, opt, loader)
    it = iter(run.steps(loader, steps=at + STEPS if resume == "never" else None))
    batch = next(it)
    drawn = torch.rand(4)
    every = [torch.empty(4) for _ in range(world)]
    dist.all_gather(every, drawn)
    if resume == "never":  # then train on, saving, for the resumed run
        run.backward(model(batch).pow(2).mean())
        run.optimizer_step(opt)
        for batch in it:
            run.backward(model(batch).pow(2).mean())
            run.optimizer_step(opt)
    it.close()
    run.close()
    return {"at": at, "every": every}


@pytest.mark.timeout(180)
def test_dropout_stream_per_data_parallel_rank_shared_by_tensor_parallel_ranks(
    tmp_path: Path,
) -> None:
    """Before: every rank drew the same numbers under DDP (torch.manual_seed(seed)
    everywhere), and a resume on another layout re-seeded per global rank, so the two
    tensor-parallel ranks of one data-parallel coordinate then drew differently."""
    [dp_run, _] = run_distributed(draws, 2, tmp_path, 1, "never")
    a, b = dp_run["every"]
    assert not torch.equal(a, b), "two data-parallel ranks drew the same numbers"
    # The same checkpoints, resumed on 2 ranks as tensor parallel x 1 data-parallel rank.
    [tp_run, _] = run_distributed(draws, 2, tmp_path, 2, "auto")
    assert tp_run["at"] == STEPS
    a, b = tp_run["every"]
    assert torch.equal(a, b), "the tensor-parallel ranks of one coordinate drew differently"
