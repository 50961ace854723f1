"""One process: fp16/bf16 under DDP (autocast), the loss scaler's presence, torch.compile per
block and the loss-parallel error. fp16 numerics on 2 ranks: tests/dist/test_layouts_precision.py."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel

from meshrun.config import ConfigError, ParallelConfig, load_config, validate_for_world
from meshrun.demo.model import GPT, demo_config
from meshrun.parallel import build_grad_scaler, parallelize
from meshrun.parallel.tp import loss_parallel_plan

CPU = torch.device("cpu")


def tiny(seed: int = 7) -> GPT:
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(demo_config("tiny"), n_layer=2))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ddp_param_dtype_runs_the_forward_under_autocast(dtype: str) -> None:
    model = parallelize(nn.Linear(4, 4), None, ParallelConfig(param_dtype=dtype), CPU)
    out = model(torch.ones(2, 4))
    assert out.dtype == getattr(torch, dtype)  # computed in the low precision
    assert model.weight.dtype == torch.float32  # the master weights stay fp32
    fp32 = parallelize(nn.Linear(4, 4), None, ParallelConfig(), CPU)
    assert fp32(torch.ones(2, 4)).dtype == torch.float32


def test_only_fp16_gets_a_loss_scaler() -> None:
    scaler = build_grad_scaler(ParallelConfig(param_dtype="float16"), CPU)
    assert scaler is not None and scaler.get_scale() == 2.0**16
    for dtype in ("float32", "bfloat16"):
        assert build_grad_scaler(ParallelConfig(param_dtype=dtype), CPU) is None


def test_loss_parallel_needs_tensor_parallel() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.loss_parallel = true splits .* tp=1"):
        parallelize(tiny(), None, ParallelConfig(loss_parallel=True), CPU)
    with pytest.raises(ConfigError, match=r"parallel\.loss_parallel = true .* has tp=1"):
        validate_for_world(load_config(None, [("parallel.loss_parallel", "true")]), 2)


def test_loss_parallel_plan_splits_the_head_over_the_vocabulary() -> None:
    plan = loss_parallel_plan(tiny(), {})
    head = plan["lm_head"]
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Shard(-1),)
    assert head.use_local_output is False  # DTensor logits, for loss_parallel()
    with pytest.raises(ConfigError, match=r"lm_head.*Linear has none"):
        loss_parallel_plan(nn.Linear(4, 4), {})


def test_compile_is_applied_per_block_and_keeps_the_keys() -> None:
    plain = list(tiny().state_dict())
    model = parallelize(tiny(), None, ParallelConfig(compile=True, activation_checkpoint=1), CPU)
    blocks = list(model.blocks)
    assert len(blocks) == 2
    assert all(b._compiled_call_impl is not None for b in blocks)  # nn.Module.compile, in place
    assert model._compiled_call_impl is None  # only the blocks, not the whole model
    assert list(model.state_dict()) == plain  # checkpoints do not depend on parallel.compile


def test_compile_needs_blocks() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.compile = true, but Linear has no blocks"):
        parallelize(nn.Linear(4, 4), None, ParallelConfig(compile=True), CPU)


@pytest.mark.skipif(
    not os.environ.get("MESHRUN_COMPILE_TESTS"),
    reason="inductor's C++ compile of the tiny GPT takes ~60 s on 2 shared CPU cores (measured "
    "63 s); set MESHRUN_COMPILE_TESTS=1 to run it",
)
@pytest.mark.timeout(600)
def test_compiled_blocks_match_eager() -> None:
    eager, compiled = tiny(), parallelize(tiny(), None, ParallelConfig(compile=True), CPU)
    x = torch.randint(0, 16, (4, 33), generator=torch.Generator().manual_seed(0))
    a, b = eager(x[:, :-1], x[:, 1:]), compiled(x[:, :-1], x[:, 1:])
    a.backward()
    b.backward()
    assert float(b) == pytest.approx(float(a), rel=1e-5)
    for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)
