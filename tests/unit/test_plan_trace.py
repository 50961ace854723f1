"""Traced memory (parallel/memory_trace.py): one rank's step on fake tensors in a fake world.

The model states are known exactly, so the trace's parameter and optimizer bytes are checked
against them under each data-parallel layout; activations must grow with the micro-batch and
shrink under checkpointing; the reserved model is checked as arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshrun.demo.model import GPT, GPTConfig
from meshrun.parallel.memory_trace import FRAGMENTATION, SEGMENT, TraceLayout, reserved_bytes, trace

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


def test_plan_cli_decides_fits_by_the_trace_and_prints_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from meshrun.cli.main import main

    (tmp_path / "tiny_model.py").write_text(
        "from meshrun.demo.model import GPT, GPTConfig\n"
        "def build():\n    return GPT(GPTConfig(seq_len=64, n_layer=2, n_head=2, d_model=64))\n"
    )
    layout = "dp_shard=2,zero=3,micro_batch=2"
    argv = ["plan", "--model", f"{tmp_path}/tiny_model.py:build", "--gpus-per-node", "2"]
    assert main([*argv, "--global-batch", "8", "--layout", layout, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["layouts"][0]
    traced = row["traced_memory_gb"]
    assert 0 < traced["allocated"] <= traced["reserved"] < traced["needed"]
    assert any(n.startswith("formula ") and "traced" in n for n in row["notes"])
    assert row["fits"] is (traced["needed"] <= 80.0)
