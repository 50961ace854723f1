"""The trace of interleaved 1F1B (parallel/trace_stages.py) against a real 2-rank pipeline.

A 4-block demo GPT on 2 Gloo ranks, 2 stages a rank (stages 0 and 2 on rank 0, 1 and 3 on
rank 1), 4 micro-batches, through meshrun's pipeline (torch's ScheduleInterleaved1F1B). Each
rank's peak of one step after a warm-up step, counted by torch's MemTracker over its stages,
optimizer, batch and receive buffers, against the trace of that rank: both stages, torch's own
order of their forwards and backwards, and the sends torch holds until the step's end.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import run_distributed
from meshrun.demo.model import GPT, GPTConfig
from meshrun.parallel.memory_trace import TraceLayout, trace
from meshrun.parallel.trace_stages import interleaved_positions
from pipeline_peak import pipeline_peak

pytestmark = pytest.mark.timeout(180)

SEQ, ROWS, CHUNKS = 64, 2, 4


def _gpt() -> nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(seq_len=SEQ, n_layer=4, n_head=2, d_model=64))


def _rank(rank: int, world: int) -> float:
    from meshrun.config import ParallelConfig

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = ParallelConfig(
            pp=2, pp_schedule="interleaved", pp_virtual_stages=2, pp_microbatches=CHUNKS
        )
        return pipeline_peak(_gpt(), cfg, ROWS, SEQ, 256)
    finally:
        dist.destroy_process_group()


def test_rank_0_runs_its_first_stages_microbatches_first() -> None:
    first, last = interleaved_positions(4, 2, 2, CHUNKS)
    assert [p.index for p in first.stages] == [0, 2] and [p.index for p in last.stages] == [1, 3]
    forwards = [(s, mb) for s, kind, mb in first.ops if kind == "F"]
    assert forwards[:4] == [(0, 0), (0, 1), (2, 0), (2, 1)]  # torch's warm-up on rank 0
    assert len(first.ops) == len(last.ops) == 2 * 2 * CHUNKS  # every forward and backward


def test_each_traced_rank_is_within_5_percent_of_its_real_rank() -> None:
    measured = run_distributed(_rank, 2, timeout=150)
    lay = TraceLayout(
        pp=2,
        micro_batch=ROWS,
        seq=SEQ,
        precision="fp32",
        microbatches=CHUNKS,
        schedule="interleaved",
        virtual=2,
        gpu=False,
    )
    traced = trace(_gpt(), lay)
    errors = [t / m - 1 for t, m in zip(traced.stages, measured, strict=True)]
    assert all(abs(e) <= 0.05 for e in errors), (traced.stages, measured)
    one_stage = trace(_gpt(), dataclasses.replace(lay, virtual=1))
    assert traced.stages[0] > one_stage.stages[0]  # two stages' states and activations
