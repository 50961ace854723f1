"""A Hugging Face MoE model (Qwen3-MoE, built on meta) through meshrun's pipeline in bf16 on 2
Gloo ranks: the split's check on fake tensors used to compute in fp32, where torch's meta
kernel for the experts' grouped matmul takes bf16 only, and refused the model before step 1.
Now it trains (1F1B, 4 micro-batches), and the trace of the same layout gives each stage's
peak within 5 % of its rank's measured one (parallel/trace_stages.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import moe_models
from _dist import run_distributed
from meshrun.parallel.memory_trace import TraceLayout, trace

pytestmark = pytest.mark.timeout(180)

ROWS, CHUNKS = 2, 4


def _meta_moe() -> nn.Module:
    with torch.device("meta"):
        return moe_models.tiny_qwen3_moe()


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _rank(rank: int, world: int) -> float:
    from meshrun.config import ParallelConfig
    from meshrun.parallel import build_optimizer, parallelize_pipeline
    from meshrun.parallel.trace_stages import measured_stage_peak
    from meshrun.runtime.mesh import ParallelDims, build_mesh

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = build_mesh(ParallelDims(2, 1, 1, 1), "cpu")
        cfg = ParallelConfig(pp=2, pp_microbatches=CHUNKS, param_dtype="bfloat16")
        pipe = parallelize_pipeline(_meta_moe(), mesh, cfg, torch.device("cpu"), _loss)
        opt = build_optimizer(pipe, torch.optim.AdamW, mesh, cfg, lr=1e-4, foreach=False)
        shape = (ROWS * CHUNKS, moe_models.SEQ + 1)
        tokens = torch.randint(0, moe_models.VOCAB, shape, generator=torch.Generator())
        return measured_stage_peak(pipe, opt, tokens)  # two 1F1B steps, the second tracked
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
