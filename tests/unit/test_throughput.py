"""Throughput for any workload: tokens counted only where they are tokens, MFU from FLOPs per
sample or per token (Hugging Face causal LMs from their config), the GPU table as a leaf, and
the SyncBatchNorm checks that need no process group."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from torch import nn

from meshrun.config import ConfigError
from meshrun.monitor import MetricsLogger
from meshrun.monitor.mfu import ModelFlops, hf_causal_lm_flops, model_flops
from meshrun.monitor.throughput import count_tokens_per_sample, resolve_tokens_per_sample
from meshrun.parallel.norms import batchnorm_names, check_sync_device


def test_tokens_are_counted_on_integer_ids_only() -> None:
    ids = torch.randint(0, 100, (4, 32))
    images = torch.randn(4, 3, 8, 8)
    labels = torch.randint(0, 10, (4,))
    assert count_tokens_per_sample(ids) == 32
    assert count_tokens_per_sample((ids, ids)) == 32
    assert count_tokens_per_sample({"attention_mask": torch.ones(4, 7), "input_ids": ids}) == 32
    # An image batch's dim 1 is its channels: never tokens, whatever else the batch holds.
    assert count_tokens_per_sample(images) is None
    assert count_tokens_per_sample({"image": images, "label": labels}) is None
    assert count_tokens_per_sample({"label": labels, "image": images}) is None  # 1-D ints
    assert count_tokens_per_sample((torch.ones(4, 5, dtype=torch.bool),)) is None
    assert count_tokens_per_sample(["a", "b"]) is None
    assert resolve_tokens_per_sample(images, 196) == 196  # given: patches counted as tokens
    assert resolve_tokens_per_sample(ids, None) == 32


def rows_of(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_unknown_tokens_give_samples_per_s_only(tmp_path: Path) -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    with MetricsLogger(tmp_path, is_main=True, console=console, world_size=2) as m:
        for step in (1, 2, 3):
            m.log_step(step, loss=1.0, lr=1e-3, step_time_s=0.25, samples=16, tokens=None)
        summary = m.summary()
    step_rows = [r for r in rows_of(tmp_path) if "step" in r]
    assert step_rows[0]["samples_per_s"] == pytest.approx(64.0)
    assert step_rows[0]["samples_per_s_per_rank"] == pytest.approx(32.0)
    for row in [*step_rows, summary]:
        assert not any(k.startswith("tokens") for k in row), sorted(row)
    assert "64.0 samples/s" in buf.getvalue() and "tok/s" not in buf.getvalue()


def test_mfu_from_flops_per_sample_counts_images_not_channels(tmp_path: Path) -> None:
    # 3-channel images, FLOPs per image given: 16 images in 0.25 s at 2e9 FLOPs each over
    # 2 ranks x 1e11 peak = 64%. Channels counted as tokens would have tripled it.
    flops = ModelFlops("metrics.flops_per_sample", per_sample=2e9)
    with MetricsLogger(tmp_path, is_main=True, progress=False, world_size=2) as m:
        m.set_flops(flops, peak_flops_per_rank=1e11)
        for step in (1, 2):
            m.log_step(step, loss=1.0, lr=1e-3, step_time_s=0.25, samples=16, tokens=None)
        summary = m.summary()
    rows = [r for r in rows_of(tmp_path) if "step" in r]
    assert rows[0]["mfu"] == pytest.approx(2e9 * 64 / 2e11)
    assert summary["mfu"] == pytest.approx(0.64)
    with pytest.raises(ValueError, match="peak must be > 0"):
        m.set_flops(flops, 0.0)


def test_model_flops_sources() -> None:
    assert model_flops(nn.Linear(4, 4), 0.0) is None  # neither given nor a known LM
    given = model_flops(nn.Linear(4, 4), 5e8)
    assert given is not None and given.per_sample == 5e8
    assert given.per_second(10.0, None) == pytest.approx(5e9)


def test_hf_causal_lm_flops_follow_the_planners_formula() -> None:
    transformers = pytest.importorskip("transformers")
    from meshrun.plan.cost import Model, model_flops_per_iteration

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config)
    flops = hf_causal_lm_flops(model)
    assert flops is not None and flops.per_token is not None and "LlamaForCausalLM" in flops.source
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    shape = Model(2, 64, 4, 256, seq=32, kv_heads=2, ffn=128, layer_params=layer)
    assert flops.per_token(32) == pytest.approx(model_flops_per_iteration(shape, 1) / 32)
    # 6 FLOPs per block weight per token dominate; longer sequences cost more per token.
    assert flops.per_token(32) > 6 * 2 * layer * 0.9
    assert flops.per_token(256) > flops.per_token(32)
    # Per-token FLOPs x tokens/s, with the tokens per sample the rates imply (32).
    assert flops.per_second(10.0, 320.0) == pytest.approx(flops.per_token(32) * 320)
    assert flops.per_second(10.0, None) is None


def test_transformers_is_not_imported_for_other_models() -> None:
    code = (
        "import sys, torch; from meshrun.monitor.mfu import model_flops; "
        "assert model_flops(torch.nn.Conv2d(3, 4, 3), 0.0) is None; "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_gpu_table_is_one_leaf_both_read() -> None:
    import meshrun.plan
    import meshrun.specs.gpus

    assert meshrun.plan.GPUS is meshrun.specs.gpus.GPUS
    assert meshrun.specs.gpus.gpu_key("NVIDIA H100 80GB HBM3") == "h100-sxm"
    with pytest.raises(ConfigError, match="no bf16 tensor cores"):
        meshrun.specs.gpus.get_gpu("v100").peak_flops("bf16")


def test_sync_batchnorm_on_cpu_is_refused_naming_the_key() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.BatchNorm1d(2))
    assert batchnorm_names(model) == ["1", "3"]
    assert batchnorm_names(nn.BatchNorm2d(4)) == ["<root>"]
    with pytest.raises(ConfigError, match=r"parallel\.sync_batchnorm = true.*cpu"):
        check_sync_device(torch.device("cpu"), batchnorm_names(model))
    check_sync_device(torch.device("cuda", 0), batchnorm_names(model))  # no error: a check only
