"""The gradient norm and clip of parallel/grads.py in one process: float64 over a
vocabulary-sized gradient (torch's fp32 CPU norm is off by ~1e-4 there), the coefficient, the
tied copy counted once (also through a ZeRO-1 alias), and the inf-norm."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from meshrun.parallel.grads import (
    clip_coefficient,
    clip_grad_norm_,
    clip_grads_,
    grad_norm,
    grad_sq_share,
)


def _param(values: torch.Tensor) -> nn.Parameter:
    p = nn.Parameter(torch.zeros_like(values))
    p.grad = values.clone()
    return p


def _vocab_sized() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(4_000_000, generator=g) * 1e-3
    grad[:100] *= 100  # a few large rows, as a vocabulary gradient has
    return grad


def test_the_norm_of_a_vocabulary_sized_gradient_is_float64_exact() -> None:
    grad = _vocab_sized()
    exact = float(grad.double().pow(2).sum().sqrt())
    torch_fp32 = float(torch.nn.utils.get_total_norm([grad]))
    assert abs(torch_fp32 - exact) / exact > 1e-5  # what the old clip used, measured
    p = _param(grad)
    assert abs(grad_norm([p]) - exact) / exact < 1e-12
    assert abs(math.sqrt(grad_sq_share([p], holders=1)) - exact) / exact < 1e-12
    # Split in pieces (as shards are), the same number.
    pieces = [_param(c) for c in grad.chunk(3)]
    assert abs(grad_norm(pieces) - exact) / exact < 1e-12


def test_clip_scales_by_one_float64_coefficient_and_leaves_small_gradients_alone() -> None:
    a, b = _param(torch.tensor([3.0, 0.0])), _param(torch.tensor([0.0, 4.0]))
    norm = clip_grad_norm_([a, b], max_norm=1.0)
    assert norm.dtype == torch.float64 and float(norm) == 5.0
    coef = clip_coefficient(1.0, 5.0)
    assert coef == 1.0 / (5.0 + 1e-6)
    assert torch.equal(a.grad, torch.tensor([3.0, 0.0]) * coef)  # in the gradient's dtype
    small = _param(torch.tensor([0.1, 0.2]))
    before = small.grad.clone()
    assert clip_grads_([small], max_norm=1.0, total_norm=grad_norm([small])) == 1.0
    assert torch.equal(small.grad, before)  # bitwise untouched at coefficient 1


def test_a_tied_copy_counts_once_also_through_an_alias() -> None:
    first, second = _param(torch.tensor([3.0])), _param(torch.tensor([3.0]))
    other = _param(torch.tensor([4.0]))
    second.meshrun_tied_replica = True  # type: ignore[attr-defined]  # parallel/pp/tied.py
    assert grad_norm([first, second, other]) == 5.0
    alias = _param(torch.tensor([3.0]))  # a pipeline under ZeRO-1 steps plain aliases
    alias.meshrun_view_of = second  # type: ignore[attr-defined]
    assert grad_norm([first, alias, other]) == 5.0
    clip_grad_norm_([first, alias, other], max_norm=1.0)  # the copy is still scaled
    assert torch.equal(alias.grad, first.grad)


def test_inf_norm_and_no_gradients() -> None:
    a, b = _param(torch.tensor([-7.0, 2.0])), _param(torch.tensor([5.0]))
    assert grad_norm([a, b], norm_type=math.inf) == 7.0
    none = nn.Parameter(torch.ones(2))
    assert grad_norm([none]) == 0.0 and grad_norm([]) == 0.0


def test_the_step_line_and_metrics_jsonl_carry_grad_norm(tmp_path: Path) -> None:
    from meshrun.monitor import METRICS_FILE, MetricsLogger
    from meshrun.monitor.metrics_view import Status

    line = Status(3, 10, 2.5, 1e-3, 0.1, 80.0, None, 1.0, grad_norm=0.8125).plain_line()
    assert line.startswith("step  3/10 | loss 2.5000 | grad_norm 0.8125 | lr 1.00e-03 |")
    assert "grad_norm" not in Status(3, 10, 2.5, 1e-3, 0.1, 80.0, None, 1.0).plain_line()
    with MetricsLogger(tmp_path, is_main=True, total_steps=2, progress=False) as m:
        m.log_step(
            1, loss=2.0, lr=1e-3, step_time_s=0.1, samples=8, tokens=None, extra={"grad_norm": 0.5}
        )
    row = json.loads((tmp_path / METRICS_FILE).read_text().splitlines()[0])
    assert row["grad_norm"] == 0.5
