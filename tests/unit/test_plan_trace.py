"""Traced memory (plan/trace.py): one rank's step on fake tensors in a fake world.

The model states are known exactly, so the trace's parameter and optimizer bytes are checked
against them under each data-parallel layout; activations must grow with the micro-batch and
shrink under checkpointing; the reserved model is checked as arithmetic."""

from __future__ import annotations

import pytest
import torch

from meshrun.demo.model import GPT, GPTConfig
from meshrun.plan.trace import FRAGMENTATION, SEGMENT, TraceLayout, reserved_bytes, trace

pytestmark = pytest.mark.timeout(120)


def _gpt(n_layer: int = 2) -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(seq_len=64, n_layer=n_layer, n_head=2, d_model=64))


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_reserved_is_allocated_plus_waste_and_pools_in_whole_segments() -> None:
    got = reserved_bytes(100 * SEGMENT, comm_pools=SEGMENT)
    assert got == SEGMENT * -(-(100 * SEGMENT * (1 + FRAGMENTATION) + SEGMENT) // SEGMENT)
    assert got % SEGMENT == 0


def test_model_states_match_each_layout_exactly() -> None:
    model = _gpt()
    n = _numel(model)
    cpu = dict(micro_batch=1, seq=64, precision="fp32", gpu=False)
    ddp = trace(model, TraceLayout(dp_shard=2, zero=0, **cpu))  # type: ignore[arg-type]
    assert ddp.parts["params"] == pytest.approx(4 * n, rel=0.02)
    assert ddp.parts["optimizer"] == pytest.approx(8 * n, rel=0.02)  # AdamW: two fp32 states
    fsdp = trace(model, TraceLayout(dp_shard=2, zero=3, **cpu))  # type: ignore[arg-type]
    assert fsdp.parts["optimizer"] == pytest.approx(8 * n / 2, rel=0.05)
    assert model.tok_emb.weight.device.type == "meta"  # the user's model is not changed


def test_activations_follow_micro_batch_and_checkpointing() -> None:
    model = _gpt()
    base = dict(dp_shard=2, zero=3, seq=64, precision="fp32", gpu=False)
    one = trace(model, TraceLayout(micro_batch=1, **base))  # type: ignore[arg-type]
    four = trace(model, TraceLayout(micro_batch=4, **base))  # type: ignore[arg-type]
    full = trace(model, TraceLayout(micro_batch=4, ac="full", **base))  # type: ignore[arg-type]
    assert four.allocated > one.allocated
    assert full.parts["activations"] < four.parts["activations"]


def test_a_deep_model_is_traced_at_two_depths_and_extrapolated() -> None:
    lay = TraceLayout(dp_shard=2, zero=3, micro_batch=2, seq=64, precision="fp32", gpu=False)
    whole = trace(_gpt(3), lay)
    deep = trace(_gpt(6), lay)
    assert whole.blocks == (3,) and deep.blocks == (2, 3)
    per_block = (deep.allocated - whole.allocated) / 3
    assert per_block > 0
