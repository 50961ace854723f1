"""How many collectives meshrun itself issues per optimizer step, counted on a real 2-rank Gloo
DDP run of the demo's tiny GPT with every per-step subsystem on: the numerics guard, the
preemption handlers (``checkpoint.on_signal``), gradient clipping (its norm is taken every
step), user state registered with ``run.resume`` (a replicated object, checked at each save,
and a per-rank one) and async interval saves, so that some steps run with a save in flight.

The count: each ``torch.distributed`` collective is wrapped (the real function still runs on
the real process group) and a call is counted when the frame that made it is meshrun's code.
DDP's gradient buckets (its C++ reducer, or the comm hook torch's ``default_hooks`` runs) and
DCP's own collectives inside a save are torch's calls, so they are not counted. Steps that
start or commit a checkpoint are set apart (the save's own commit protocol runs there), and so
is step 1 (it reports the model-state table, once per run).

A step's window runs from the top of its loop body to the top of the next one: a step is saved
once its loop body has run (``run.steps``, asked for the next micro-batch, runs the save), so
the save of step 4 is made between the body of step 4 and that of step 5 and belongs to step 4.
Counted from one ``run.optimizer_step`` to the next, it would land on step 5, an ordinary step.

The figure per ordinary step: 1 (the one per-step agreement, which also carries the loss the
metrics log and each rank's share of the squared gradient norm), where three separate
all-reduces ran before (guard with the loss, preemption flag, async-save poll while one is in
flight) and a fourth would take the clip's norm.
"""

from __future__ import annotations

import collections
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import meshrun
from _dist import run_distributed

STEPS = 14
INTERVAL = 4
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "gather",
    "gather_object",
    "scatter",
    "all_to_all",
    "reduce",
    "monitored_barrier",
)
Batch = dict[str, torch.Tensor]


class Tally:
    """A user object with state: the steps it has seen (the same on every rank, or this rank's
    own when ``per_rank``)."""

    def __init__(self, start: int = 0) -> None:
        self.n = start

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


class Tokens(Dataset[Batch]):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Batch:
        return {"input": self.x[i, :-1], "target": self.x[i, 1:]}


def install_counter(calls: list[str]) -> None:
    """Wrap every collective of ``torch.distributed``; record ``file:function`` of meshrun
    callers (the real collective runs either way)."""
    src = str(Path(meshrun.__file__).parent)

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(src):
                where = Path(caller.f_code.co_filename).relative_to(src)
                calls.append(f"{name} {where}:{caller.f_code.co_name}")
            return fn(*args, **kwargs)

        return counted

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


def count(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    from meshrun.demo.model import GPT, demo_config

    calls: list[str] = []
    install_counter(calls)
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = run_dir, "cpu", 60.0
    cfg.data.global_batch, cfg.data.micro_batch = 16, 8  # 2 ranks x 8: one micro-step a step
    cfg.optim.steps, cfg.optim.grad_clip = STEPS, 1.0
    cfg.metrics.progress = False
    cfg.checkpoint.interval, cfg.checkpoint.async_ = INTERVAL, True
    run = meshrun.init(cfg, argv=[])
    gpt = demo_config("tiny")
    torch.manual_seed(0)
    model = run.parallelize(GPT(gpt))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = run.dataloader(Tokens(512, gpt.seq_len, gpt.vocab_size))
    shared, own = Tally(), Tally(start=1000 * rank)
    run.resume(model, opt, loader, per_rank={"own": own}, shared=shared)
    root = run.run_dir / "checkpoints"
    per_step: dict[int, list[str]] = {}
    committed: dict[int, bool] = {}
    seen: set[str] = set()
    mark, done = len(calls), 0

    def close_window(step: int) -> None:
        """The calls since the last mark are ``step``'s, its deferred save included."""
        nonlocal mark, seen
        per_step[step], mark = calls[mark:], len(calls)
        now = {p.name for p in root.glob("step_*") if not p.name.endswith(".tmp")}
        committed[step], seen = bool(now - seen), seen | now

    for batch in run.steps(loader):
        if done:  # run.steps has run the save of the step before, if one was due
            close_window(done)
        run.backward(model(batch["input"], batch["target"]))
        run.optimizer_step(opt)
        shared.n, own.n, done = shared.n + 1, own.n + 1, run.step
    close_window(done)  # the end of run.steps ran the last step's save, if due
    run.close()
    return {"per_step": per_step, "committed": committed}


@pytest.mark.timeout(240)
def test_one_collective_per_step_from_meshrun(tmp_path: Path) -> None:
    r0, r1 = run_distributed(count, 2, str(tmp_path), timeout=200)
    for r in (r0, r1):
        saves = {s for s in range(1, STEPS + 1) if s % INTERVAL == 0}
        # Step 1 also reports the model-state table once per run (a gather, not per step).
        ordinary = [s for s in range(2, STEPS + 1) if s not in saves and not r["committed"][s]]
        print("per step:", {s: len(c) for s, c in r["per_step"].items()})
        print("by call site:", collections.Counter(c for s in ordinary for c in r["per_step"][s]))
        print(
            f"ordinary steps {ordinary}; save steps {sorted(saves)}; committed at",
            [s for s, c in r["committed"].items() if c],
        )
        assert len(ordinary) >= STEPS // 2, r["committed"]
        # The windows are the steps': each interval save starts (its directory is prepared,
        # a collective) in the window of the step it saves, not in the next one.
        for s in sorted(saves):
            assert any(" checkpoint/" in c for c in r["per_step"][s]), (s, r["per_step"][s])
        # The first async save starts with none in flight: the agreement and one collective of
        # the save's own (its directory's barrier, which also compares the replicated object's
        # digests).
        assert len(r["per_step"][INTERVAL]) == 2, r["per_step"][INTERVAL]
        for s in ordinary:
            assert len(r["per_step"][s]) <= 1, (s, r["per_step"][s])
    assert r0["per_step"] == r1["per_step"]  # the same collectives, in the same order
