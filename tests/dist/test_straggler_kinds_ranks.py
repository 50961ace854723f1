"""A chronic straggler and a one-off stall told apart, in one real 2-rank Gloo world.

Checks every 2 steps (monitor.straggler_every), 4 remembered (straggler_windows), chronic at
3 flagged (straggler_chronic). The delays are sleeps in the user's loop body before
``run.backward`` (the rank's own time), hundreds of times a step of this tiny model, and the
flag floor (straggler_min_s) is 0.1 s per step, so nothing but the planted delays can be
flagged and no assertion rests on a duration:

  steps 1-2    no delay (the first step's warm-up, of any length, is no planted flag)
  steps 3-10   rank 1 sleeps CHRONIC_S every step: flagged at checks 4, 6 (transient: 1 and 2
               flags so far), 8, 10 (chronic: 3 and 4 of the last 4)
  steps 11-18  no delay, except rank 0 sleeps STALL_S once, at step 15: flagged at check 16,
               transient (1 of the last 4)
"""

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import meshrun
from _dist import run_distributed

CHRONIC_S, CHRONIC_FROM, CHRONIC_TO = 0.3, 3, 10
STALL_S, STALL_AT = 1.2, 15
STEPS = 18


def train(rank: int, world_size: int, run_dir: str) -> None:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = run_dir, "cpu", 60.0
    cfg.data.global_batch, cfg.data.micro_batch = 8, 4
    cfg.optim.steps = STEPS
    cfg.metrics.progress = False
    m = cfg.monitor
    m.straggler_every, m.straggler_windows, m.straggler_chronic = 2, 4, 3
    m.straggler_min_s, m.straggler_top_k = 0.1, 2
    run = meshrun.init(cfg, argv=[])
    torch.manual_seed(0)
    model = run.parallelize(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 2))
    for x, y in run.steps(run.dataloader(data)):
        step = run.step + 1  # the step this micro-batch belongs to
        chronic = rank == 1 and CHRONIC_FROM <= step <= CHRONIC_TO
        if chronic or (rank == 0 and step == STALL_AT):
            time.sleep(CHRONIC_S if rank == 1 else STALL_S)
        run.backward(F.mse_loss(model(x), y))
        run.optimizer_step(opt)
    run.close()


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(180)
def test_a_chronic_straggler_and_a_one_off_stall_are_told_apart(tmp_path: Path) -> None:
    run_distributed(train, 2, str(tmp_path), timeout=150)
    recs = records(tmp_path)
    flags = [(e["step"], e["rank"], e["kind"]) for e in recs if e.get("event") == "straggler"]
    print("flags:", flags)
    planted = [(s, 1, k) for s, k in ((4, "transient"), (6, "transient"))]
    planted += [(8, 1, "chronic"), (10, 1, "chronic"), (16, 0, "transient")]
    assert [f for f in flags if f in planted] == planted
    assert not any(r == 0 and k == "chronic" for _, r, k in flags)  # the stall never is
    # The top-k in each check's record: rank 1 slowest, chronic, while it is.
    ranks = {e["step"]: e for e in recs if e.get("event") == "ranks"}
    assert sorted(ranks) == list(range(2, STEPS + 1, 2))
    top = ranks[10]["slowest"]
    assert [t["rank"] for t in top] == [1, 0] and top[0]["kind"] == "chronic"
    assert top[0]["own_s"] >= CHRONIC_S and set(top[0]) >= {"compute_s", "optimizer_s"}
    # The console (rank 0's log): rank 1 said once as chronic, the stall as transient, the
    # slowest ranks at the end.
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert log.count("chronic straggler: rank 1 on ") == 1, log
    assert "straggler: rank 0 on " in log and "transient: flagged at 1 of the last 4" in log
    assert "slowest ranks (data wait + own time, moving average of the last 4 check(s))" in log
