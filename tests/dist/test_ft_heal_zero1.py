"""What a ZeRO-1 replica group sends a healing peer (ft/heal.py), on 2 real Gloo ranks.

``ZeroRedundancyOptimizer.state_dict()`` raises before a ``consolidate_state_dict()`` and then
holds the whole state on one rank only, so each rank sends its own partition. Here one 2-rank
spawn plays both groups: each rank's blob, loaded into a fresh ZeRO-1 optimizer on the same
rank, gives that rank's optimizer state exactly and the same next step; the other rank's
blob, or a plain optimizer's whole state, is refused (never a partition silently left unset).
tests/e2e/test_ft_layouts.py heals a killed ZeRO-1 group through real torchft processes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from _dist import run_distributed
from meshrun.ft.heal import StateCodec
from meshrun.runtime.state import TrainState


def _zero1() -> tuple[nn.Module, ZeroRedundancyOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(1))).sum().backward()
    opt.step()
    opt.zero_grad()


def _moments(opt: ZeroRedundancyOptimizer) -> list[torch.Tensor]:
    return [v for p in opt.optim.state for v in opt.optim.state[p].values()]


def _check(rank: int, world_size: int) -> list[str]:
    dist.init_process_group("gloo")
    model, opt = _zero1()
    _step(model, opt)
    opt.param_groups[0]["lr"] = 0.05  # as an LR scheduler sets it after a step
    state = TrainState(models=[model])
    state.optimizer, state.step = opt, 1
    blobs: list[Any] = [None] * world_size
    dist.all_gather_object(blobs, StateCodec(state, group_index=0).save())
    refused = []

    healed, healed_opt = _zero1()
    # A restarted group heals before its optimizer is known, then places the state on it.
    codec = StateCodec(TrainState(models=[healed]), group_index=1)
    codec.load(blobs[rank])
    codec.apply_pending_optimizer(healed_opt)
    mine, sent = _moments(healed_opt), _moments(opt)
    assert mine and all(torch.equal(a, b) for a, b in zip(mine, sent, strict=True))
    assert healed_opt.param_groups[0]["lr"] == 0.05
    _step(model, opt)
    _step(healed, healed_opt)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), healed.parameters(), strict=True)
    )

    for blob in (blobs[1 - rank], _plain_blob()):
        other, other_opt = _zero1()
        codec = StateCodec(TrainState(models=[other]), group_index=1)
        codec.load(blob)
        with pytest.raises(RuntimeError, match="ZeRO-1") as err:
            codec.apply_pending_optimizer(other_opt)
        refused.append(str(err.value))
    return refused


def _plain_blob() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt)
    state = TrainState(models=[model])
    state.optimizer, state.step = opt, 1
    return StateCodec(state, group_index=0).save()


@pytest.mark.timeout(120)
def test_each_rank_heals_its_own_zero1_partition_and_refuses_another() -> None:
    for refused in run_distributed(_check, 2):
        assert "partition holds parameters" in refused[0], refused
        assert "sent a whole optimizer state" in refused[1], refused
