"""LR scaling rules, the warmup + decay factor, and the torch LambdaLR built from it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from meshrun.config import OptimConfig
from meshrun.runtime.schedule import build_lr_scheduler, lr_factor, scale_lr

pytestmark = pytest.mark.timeout(10)


# --- scale_lr ----------------------------------------------------------------------------


def test_linear_scaling_multiplies_by_the_batch_ratio() -> None:
    assert scale_lr(0.1, 1024, 256, "linear") == pytest.approx(0.4)
    assert scale_lr(0.1, 128, 256, "linear") == pytest.approx(0.05)


def test_sqrt_scaling_multiplies_by_the_root_of_the_ratio() -> None:
    assert scale_lr(0.1, 1024, 256, "sqrt") == pytest.approx(0.2)
    assert scale_lr(1.0, 512, 256, "sqrt") == pytest.approx(math.sqrt(2))


def test_no_scaling_keeps_the_lr() -> None:
    assert scale_lr(0.1, 1024, 256, "none") == 0.1


def test_a_zero_reference_batch_means_no_scaling() -> None:
    assert scale_lr(0.1, 1024, 0, "linear") == 0.1


def test_an_unknown_rule_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"optim\.lr_scaling = 'cube'"):
        scale_lr(0.1, 1024, 256, "cube")


# --- lr_factor ---------------------------------------------------------------------------


def test_warmup_ramps_up_to_one_at_warmup_steps() -> None:
    cfg = OptimConfig(warmup_steps=4, steps=20, decay="cosine")
    ramp = [lr_factor(s, cfg) for s in range(5)]
    assert ramp == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(a < b for a, b in itertools.pairwise(ramp))


def test_cosine_reaches_min_lr_ratio_at_steps() -> None:
    cfg = OptimConfig(warmup_steps=10, steps=110, decay="cosine", min_lr_ratio=0.1)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(60, cfg) == pytest.approx(0.55)  # halfway: cos(pi/2) = 0
    assert lr_factor(110, cfg) == pytest.approx(0.1)
    assert lr_factor(500, cfg) == pytest.approx(0.1)  # stays there after the end
    decay = [lr_factor(s, cfg) for s in range(10, 111)]
    assert all(a > b for a, b in itertools.pairwise(decay))


def test_linear_decay_midpoint() -> None:
    cfg = OptimConfig(warmup_steps=0, steps=100, decay="linear", min_lr_ratio=0.2)
    assert lr_factor(0, cfg) == pytest.approx(1.0)
    assert lr_factor(25, cfg) == pytest.approx(0.8)
    assert lr_factor(50, cfg) == pytest.approx(0.6)
    assert lr_factor(100, cfg) == pytest.approx(0.2)


def test_constant_stays_one_after_warmup() -> None:
    cfg = OptimConfig(warmup_steps=2, steps=10, decay="constant", min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(1 / 3)
    assert [lr_factor(s, cfg) for s in range(2, 50)] == [1.0] * 48


def test_warmup_longer_than_the_run_does_not_divide_by_zero() -> None:
    cfg = OptimConfig(warmup_steps=10, steps=5, decay="cosine", min_lr_ratio=0.0)
    assert lr_factor(9, cfg) == pytest.approx(10 / 11)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    assert lr_factor(11, cfg) == pytest.approx(0.0)


# --- build_lr_scheduler ----------------------------------------------------------------


def test_build_lr_scheduler_drives_a_real_optimizer() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.5)
    cfg = OptimConfig(warmup_steps=2, steps=6, decay="linear", min_lr_ratio=0.0)
    sched = build_lr_scheduler(opt, cfg)
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(7):
        param.grad = torch.ones_like(param)
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    factors = [1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    assert lrs == pytest.approx([0.5 * f for f in factors])
    assert opt.param_groups[0]["initial_lr"] == 0.5  # the optimizer's own lr is the peak
