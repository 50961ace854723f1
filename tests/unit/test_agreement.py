"""The per-step agreement in one process (no collective): slots, counts, the loss and the
named non-finite ranks; reading a step that was not exchanged is an error naming the step.
Two real ranks: tests/dist/test_agreement.py."""

import math

import pytest
import torch

from meshrun.runtime.agreement import Slot, StepAgreement


def test_flags_and_loss_in_one_exchange() -> None:
    a = StepAgreement(torch.device("cpu"), distributed=False)
    state = {"preempt": False}
    a.provide(Slot.PREEMPT, lambda: state["preempt"])
    first = a.exchange(1, loss=2.5)
    assert first.loss == 2.5 and not first.any(Slot.PREEMPT) and first.nonfinite_ranks == ()
    state["preempt"] = True
    second = a.exchange(2, loss=None)  # a rank without a loss (a pipeline stage)
    assert second.any(Slot.PREEMPT) and second.all(Slot.PREEMPT) and second.count(Slot.PREEMPT) == 1
    assert math.isnan(second.loss) and a.agreed(2) is second
    assert a.exchanges == 0  # one process: nothing goes on the wire


def test_nonfinite_loss_is_flagged_and_named() -> None:
    a = StepAgreement(torch.device("cpu"), distributed=False)
    bad = a.exchange(7, loss=math.inf)
    assert bad.any(Slot.NONFINITE) and bad.nonfinite_ranks == (0,) and math.isnan(bad.loss)


def test_reading_another_step_and_providing_the_loss_are_errors() -> None:
    a = StepAgreement(torch.device("cpu"), distributed=False)
    with pytest.raises(RuntimeError, match="no per-step agreement for step 1 \\(none yet\\)"):
        a.agreed(1)
    a.exchange(1)
    with pytest.raises(RuntimeError, match="step 2 \\(the last was for step 1\\)"):
        a.agreed(2)
    with pytest.raises(ValueError, match="agreement slot LOSS: only flag slots"):
        a.provide(Slot.LOSS, lambda: True)


def test_a_heal_inside_the_step_moves_the_agreement_to_the_step_it_continues_at() -> None:
    a = StepAgreement(torch.device("cpu"), distributed=False)
    a.exchange(4, loss=1.5)
    a.moved_to(15)  # a DiLoCo sync healed the group to its peer's step 15
    assert a.agreed(15).loss == 1.5
    with pytest.raises(RuntimeError, match="step 4"):
        a.agreed(4)
