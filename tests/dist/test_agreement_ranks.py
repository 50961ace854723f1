"""The per-step agreement on two real Gloo ranks: a flag one rank raises reaches both in the
same exchange, counts add up, a NaN names its rank, the loss is the mean the guard computed
before (the same float64 sum, bitwise), the gradient-norm shares add up in the same tensor, and
each exchange is one collective."""

from typing import Any

import pytest
import torch
import torch.distributed as dist

from _dist import run_distributed
from meshrun.runtime.agreement import Slot, StepAgreement

LOSSES = {0: [1.25, 0.1, 3.0, 2.0], 1: [0.75, 0.2, 1.0, float("nan")]}
GRAD_SQ = {0: 9.0, 1: 16.0}  # each rank's share of the squared norm: the whole norm is 5
VALUES = (Slot.LOSS, Slot.GRAD_SQ)  # summed values, not flags: no count to compare


def exchange(rank: int, world_size: int) -> list[dict[str, Any]]:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    a = StepAgreement(torch.device("cpu"))
    step = [0]
    a.provide(Slot.PREEMPT, lambda: rank == 1 and step[0] == 2)
    a.provide(Slot.SAVE_WRITING, lambda: step[0] == 3 or (rank == 0 and step[0] == 2))
    out = []
    for i, loss in enumerate(LOSSES[rank], start=1):
        step[0] = i
        got = a.exchange(i, loss=loss, grad_sq=GRAD_SQ[rank] if i == 1 else None)
        out.append(
            {
                "loss": got.loss,
                "grad_norm": got.grad_norm,
                "counts": {s.name: got.count(s) for s in Slot if s not in VALUES},
                "bad": got.nonfinite_ranks,
            }
        )
    out.append({"exchanges": a.exchanges})
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
def test_two_ranks_agree_on_every_slot() -> None:
    r0, r1 = run_distributed(exchange, 2, timeout=45)
    assert r0[:3] == r1[:3] and r0[3]["counts"] == r1[3]["counts"]  # the same on both ranks
    assert r0[-1] == r1[-1] == {"exchanges": 4}  # one all-reduce per exchange
    for i in range(3):
        assert r0[i]["loss"] == (LOSSES[0][i] + LOSSES[1][i]) / 2  # bitwise: same sum, same order
    assert r0[0]["counts"] == {"LOSS_RANKS": 2, "NONFINITE": 0, "PREEMPT": 0, "SAVE_WRITING": 0}
    assert r0[0]["grad_norm"] == r1[0]["grad_norm"] == 5.0  # sqrt(9 + 16), in the same exchange
    assert r0[1]["grad_norm"] == 0.0  # a step without a share sends none
    assert r0[1]["counts"]["PREEMPT"] == 1 and r0[1]["counts"]["SAVE_WRITING"] == 1
    assert r0[2]["counts"]["SAVE_WRITING"] == 2 and r0[2]["counts"]["PREEMPT"] == 0
    assert r0[3]["bad"] == r1[3]["bad"] == (1,) and r0[3]["counts"]["NONFINITE"] == 1
    assert r0[3]["loss"] != r0[3]["loss"] and r1[3]["loss"] != r1[3]["loss"]  # NaN on both
