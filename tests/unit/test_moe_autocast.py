"""Transformers' MoE experts under DDP's autocast (parallel/precision.py): torch's autocast has no
rule for the grouped expert matmul, so the experts computed in fp32 beside a bf16 model, and
the memory trace (fake tensors: torch's meta kernel takes bf16 only) stopped. meshrun's rule
casts its inputs to the autocast dtype, as autocast does for every other matmul."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_models
from meshrun.config import ParallelConfig
from meshrun.parallel import parallelize
from meshrun.parallel.memory_trace import TraceLayout, trace

pytestmark = pytest.mark.timeout(120)
CPU = torch.device("cpu")


class _GroupedMMDtypes(TorchDispatchMode):
    """The input dtypes of every grouped matmul run under it (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket is torch.ops.aten._grouped_mm:
            self.seen.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def test_ddp_bf16_runs_the_experts_grouped_matmul_in_bf16() -> None:
    cfg = ParallelConfig(param_dtype="bfloat16")
    model: Any = parallelize(moe_models.tiny_qwen3_moe(), None, cfg, CPU)
    assert model.config._experts_implementation == "grouped_mm"  # transformers' CPU default
    ids = torch.randint(0, moe_models.VOCAB, (2, moe_models.SEQ), generator=torch.Generator())
    with _GroupedMMDtypes() as mode:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    # up and down projections in each of 2 layers, forward and backward
    assert len(mode.seen) >= 2 * moe_models.LAYERS
    assert set(mode.seen) == {(torch.bfloat16, torch.bfloat16)}
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32  # master weights stay fp32
    assert (
        experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.dtype == torch.float32
    )
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("zero", [0, 1])
def test_trace_of_an_moe_model_under_ddp_and_zero1(zero: int) -> None:
    with torch.device("meta"):
        model = moe_models.tiny_qwen3_moe()
    n = sum(p.numel() for p in model.parameters())
    lay = TraceLayout(dp_shard=2, zero=zero, micro_batch=1, seq=16, precision="bf16", gpu=False)
    got = trace(model, lay)  # stopped on the grouped matmul's fp32 inputs before the rule
    assert got.parts["params"] == pytest.approx(4 * n, rel=0.02)  # fp32 masters, replicated
    assert got.parts["activations"] > 0


def test_meta_moe_pipeline_split_is_checked_in_the_runs_precision() -> None:
    from meshrun.parallel.pp.split import split_model
    from meshrun.parallel.pp.stages import StageModule, check_stages_reproduce, hf_context
    from meshrun.parallel.precision import compute_autocast
    from meshrun.parallel.structure import find_structure

    with torch.device("meta"):
        model = moe_models.tiny_qwen3_moe()
    s = find_structure(model)
    kwargs, shared = hf_context(model, s.block_names())
    stages = [StageModule(model, p, kwargs) for p in split_model(model, s, 2, shared).parts]
    compute = compute_autocast(ParallelConfig(pp=2, param_dtype="bfloat16"), "cpu")
    # fp32 fake tensors stopped on the grouped matmul's meta kernel, and a meta model's
    # tensors never autocast: the check now runs on fake CPU tensors under the run's autocast
    assert check_stages_reproduce(model, stages, compute).startswith("shapes only")
    assert next(model.parameters()).device.type == "meta"  # the model is not changed
