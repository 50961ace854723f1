"""A Hugging Face MoE model (Qwen3-MoE, built on meta) through meshrun's pipeline in bf16 on 2
Gloo ranks: the split's check on fake tensors used to compute in fp32, where torch's meta
kernel for the experts' grouped matmul takes bf16 only, and refused the model before step 1.
Now it trains (1F1B, 4 micro-batches), and the trace of the same layout gives each stage's
peak within 5 % of its rank's measured one (parallel/trace_stages.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moe_models
from _dist import run_distributed
from meshrun.parallel.memory_trace import TraceLayout, trace
from pipeline_peak import pipeline_peak

pytestmark = pytest.mark.timeout(180)

ROWS, CHUNKS = 2, 4


def _meta_moe() -> nn.Module:
    with torch.device("meta"):
        return moe_models.tiny_qwen3_moe()


def _rank(rank: int, world: int) -> float:
    from meshrun.config import ParallelConfig

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = ParallelConfig(pp=2, pp_microbatches=CHUNKS, param_dtype="bfloat16")
        # two 1F1B steps, the second tracked
        return pipeline_peak(_meta_moe(), cfg, ROWS, moe_models.SEQ, moe_models.VOCAB)
    finally:
        dist.destroy_process_group()


def test_meta_moe_pipeline_trains_in_bf16_and_matches_its_trace() -> None:
    measured = run_distributed(_rank, 2, timeout=150)
    lay = TraceLayout(
        pp=2,
        micro_batch=ROWS,
        seq=moe_models.SEQ,
        precision="bf16",
        microbatches=CHUNKS,
        schedule="1f1b",
        gpu=False,
    )
    traced = trace(_meta_moe(), lay)
    errors = [t / m - 1 for t, m in zip(traced.stages, measured, strict=True)]
    assert all(abs(e) <= 0.05 for e in errors), (traced.stages, measured)
