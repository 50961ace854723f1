"""Silent data corruption caught (monitor/replicas_check.py), in one real 2-rank Gloo world
under DDP: with ``monitor.replica_check_every = 2``, one bit of one parameter flipped on rank 1
after step 2 is named at the check of step 4 (rank, host, parameter) and both ranks stop
there together; the check of step 2, on equal replicas, passes."""

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import meshrun
from _dist import run_distributed

FLIP_AFTER, EVERY = 2, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)))


def train(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = run_dir, "cpu", 60.0
    cfg.data.global_batch, cfg.data.micro_batch = 8, 4
    cfg.optim.steps = 10
    cfg.metrics.progress = False
    cfg.monitor.replica_check_every = EVERY
    run = meshrun.init(cfg, argv=[])
    torch.manual_seed(0)
    model = run.parallelize(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 2))
    out: dict[str, Any] = {"error": None, "host": socket.gethostname()}
    try:
        for x, y in run.steps(run.dataloader(data)):
            run.backward(F.mse_loss(model(x), y))
            run.optimizer_step(opt)
            if rank == 1 and run.step == FLIP_AFTER and run.is_step_end:
                with torch.no_grad():  # a bit of one mantissa, as a faulty DRAM cell flips it
                    run.unwrap(model).head.weight.view(-1).view(torch.int32)[5] ^= 1 << 12
    except meshrun.monitor.ReplicaMismatchError as e:
        out["error"] = str(e)
    out["step"] = run.step
    run.close(failed=out["error"] is not None)
    return out


@pytest.mark.timeout(180)
def test_a_flipped_bit_on_rank_1_is_named_and_both_ranks_stop(tmp_path: Path) -> None:
    r0, r1 = run_distributed(train, 2, str(tmp_path), timeout=150)
    print(r1["error"])
    for r in (r0, r1):  # the same error on both ranks, at the first check after the flip
        assert r["step"] == FLIP_AFTER + EVERY
        assert r["error"] is not None and "at step 4" in r["error"]
        assert f"'head.weight': rank 0 on {r0['host']}, rank 1 on {r1['host']}" in r["error"]
        assert "embed" not in r["error"]  # only the flipped parameter
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (event,) = [x for x in lines if x.get("event") == "replica_mismatch"]
    assert event["step"] == 4 and event["params"] == [
        {"name": "head.weight", "ranks": [0, 1], "hosts": [r0["host"], r1["host"]]}
    ]
