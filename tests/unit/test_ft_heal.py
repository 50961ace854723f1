"""What a replica group sends a healing peer (ft/heal.py), without processes: the optimizer
state always travels with the weights (tests/e2e/test_ft_layouts.py runs the processes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshrun.checkpoint.targets import Targets
from meshrun.ft.heal import StateCodec
from meshrun.runtime.state import TrainState


def _trained() -> tuple[TrainState, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return TrainState(models=[model]), opt


def test_run_resume_makes_the_optimizer_known_before_the_first_step() -> None:
    state, opt = _trained()
    Targets(state, rank=0).register(state.models[0], opt)
    assert state.optimizer is opt
    blob = StateCodec(state, group_index=0).save()
    assert blob["optimizer"]["state"][0]["step"] == 1  # sent at a first quorum, before a step


def test_a_group_that_healed_and_has_not_stepped_passes_its_peers_optimizer_on() -> None:
    sender, opt = _trained()
    sender.optimizer, sender.step = opt, 5
    blob = StateCodec(sender, group_index=0).save()
    healed = TrainState(models=[nn.Linear(3, 2)])  # restarted: its optimizer not known yet
    codec = StateCodec(healed, group_index=1)
    codec.load(blob)
    passed_on = codec.save()  # a third group heals from this one before its first step
    assert passed_on["step"] == 5
    assert torch.equal(
        passed_on["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )


def test_weights_without_their_optimizer_state_are_refused() -> None:
    sender, _ = _trained()
    sender.step = 7  # at step 7 but no optimizer known: its moments would be lost
    blob = StateCodec(sender, group_index=0).save()
    assert blob["optimizer"] is None
    with pytest.raises(RuntimeError, match="group 0 is at step 7 but sent no optimizer state"):
        StateCodec(TrainState(models=[nn.Linear(3, 2)]), group_index=1).load(blob)
