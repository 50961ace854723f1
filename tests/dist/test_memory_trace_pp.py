"""The trace's pipeline stages (parallel/trace_stages.py) against a real 2-rank pipeline.

One 2-rank Gloo launch trains a 2-block demo GPT through meshrun's pipeline (pp=2, 4
micro-batches) under 1F1B and then GPipe, and counts each rank's (stage's) peak of one step
after a warm-up step with torch's MemTracker over the real tensors (parameters, gradients,
optimizer states, the stage's receive buffers, everything the step allocates). The trace of
the same layout on fake tensors must give each stage within 5 %: the embeddings only on the
first stage, the head and the loss only on the last, 1F1B's min(m, pp - s) micro-batches in
flight on stage s (2 and 1 here) and GPipe's 4 on both.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import run_distributed
from meshrun.demo.model import GPT, GPTConfig
from meshrun.parallel.memory_trace import TraceLayout, trace
from pipeline_peak import pipeline_peak

pytestmark = pytest.mark.timeout(180)

SEQ, ROWS, CHUNKS = 64, 2, 4
SCHEDULES = ("1f1b", "gpipe")


def _gpt() -> nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(seq_len=SEQ, n_layer=2, n_head=2, d_model=64))


def _peak(schedule: str) -> float:
    from meshrun.config import ParallelConfig

    cfg = ParallelConfig(pp=2, pp_schedule=schedule, pp_microbatches=CHUNKS)
    return pipeline_peak(_gpt(), cfg, ROWS, SEQ, 256)


def _rank(rank: int, world: int) -> list[float]:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return [_peak(s) for s in SCHEDULES]
    finally:
        dist.destroy_process_group()


def test_each_traced_stage_is_within_5_percent_of_its_rank() -> None:
    first, last = run_distributed(_rank, 2, timeout=150)
    for i, schedule in enumerate(SCHEDULES):
        lay = TraceLayout(
            pp=2,
            micro_batch=ROWS,
            seq=SEQ,
            precision="fp32",
            microbatches=CHUNKS,
            schedule=schedule,
            gpu=False,
        )
        traced = trace(_gpt(), lay)
        measured = (first[i], last[i])
        errors = [t / m - 1 for t, m in zip(traced.stages, measured, strict=True)]
        assert all(abs(e) <= 0.05 for e in errors), (schedule, traced.stages, measured)
        assert traced.allocated == max(traced.stages)
    # 1F1B holds 2 micro-batches on the first stage, GPipe 4: GPipe's first stage is larger
    assert first[1] > first[0]
