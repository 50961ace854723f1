"""The trace of the zero-bubble schedules (parallel/trace_ops.py) against real 2-rank pipelines.

A 4-block demo GPT on 2 Gloo ranks, 2 stages a rank, 4 micro-batches, through meshrun's
pipeline under torch's ScheduleInterleavedZeroBubble (zb1p: stages 0 and 2 on rank 0, 1 and 3
on rank 1), ScheduleZBVZeroBubble and ScheduleDualPipeV (zbv, dualpipev: a V, stages 0 and 3
on rank 0, 1 and 2 on rank 1). Each rank's peak of one step after a warm-up step, counted by
torch's MemTracker over its stages, optimizer, batch and receive buffers, against the trace
of that rank: torch's own order of its ops, each backward split where torch splits it (input
gradients with the graph kept, weight gradients later) by torch's own functions. Under the
heavy mark, the same on 4 ranks, where the two traced ranks must also be the heaviest.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import run_distributed
from meshrun.config import ConfigError
from meshrun.demo.model import GPT, GPTConfig
from meshrun.parallel.memory_trace import TraceLayout, trace
from meshrun.parallel.trace_ops import order_problem, zero_bubble_positions
from pipeline_peak import pipeline_peak

pytestmark = pytest.mark.timeout(180)

SEQ, ROWS, CHUNKS = 64, 2, 4
SCHEDULES = ("zb1p", "zbv", "dualpipev")


def _gpt(layers: int = 4) -> nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(seq_len=SEQ, n_layer=layers, n_head=2, d_model=64))


def _rank(rank: int, world: int, chunks: int = CHUNKS, layers: int = 4) -> list[float]:
    """This rank's measured peak under each schedule, one pipeline after the other."""
    from meshrun.config import ParallelConfig

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        peaks = []
        for schedule in SCHEDULES:
            cfg = ParallelConfig(
                pp=world, pp_schedule=schedule, pp_virtual_stages=2, pp_microbatches=chunks
            )
            rows = ROWS * CHUNKS // chunks
            peaks.append(pipeline_peak(_gpt(layers), cfg, rows, SEQ, 256))
        return peaks
    finally:
        dist.destroy_process_group()


def _layout(schedule: str, pp: int = 2, chunks: int = CHUNKS) -> TraceLayout:
    return TraceLayout(
        pp=pp,
        micro_batch=ROWS * CHUNKS // chunks,
        seq=SEQ,
        precision="fp32",
        microbatches=chunks,
        schedule=schedule,
        virtual=2,
        gpu=False,
    )


def test_ranks_run_torchs_split_backward_in_a_v() -> None:
    first, last = zero_bubble_positions(4, "zbv", 2, 2, CHUNKS)
    assert [p.index for p in first.stages] == [0, 3] and [p.index for p in last.stages] == [1, 2]
    kinds = [kind for _, kind, _ in first.ops]
    assert kinds.count("I") == kinds.count("W") == 2 * CHUNKS and "B" not in kinds
    # torch's ZB-V warm-up on rank 0: 2 pp - 1 forwards of stage 0, then the V's last stage
    assert first.ops[:4] == ((0, "F", 0), (0, "F", 1), (0, "F", 2), (3, "F", 0))


def test_settings_torch_cannot_run_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="pp_microbatches >= 4"):  # DualPipeV: m >= 2 pp
        zero_bubble_positions(4, "dualpipev", 2, 2, 3)
    with pytest.raises(ConfigError, match="pp_microbatches in"):  # ZB1P: whole rounds
        zero_bubble_positions(8, "zb1p", 4, 2, 9)
    with pytest.raises(ConfigError, match="dualpipev"):  # the trace refuses, never falls back
        trace(_gpt(), dataclasses.replace(_layout("dualpipev"), microbatches=3))
    ops = zero_bubble_positions(4, "zb1p", 2, 2, CHUNKS)[0].ops
    assert order_problem(ops, [0, 2], CHUNKS) is None
    assert order_problem(ops[:-1], [0, 2], CHUNKS) == "stage 0, micro-batch 3 runs 'FI'"


def test_each_traced_rank_is_within_5_percent_of_its_real_rank() -> None:
    per_rank = run_distributed(_rank, 2, timeout=150)  # [rank 0's peaks, rank 1's]
    measured = dict(zip(SCHEDULES, zip(*per_rank, strict=True), strict=True))
    for schedule in SCHEDULES:
        traced = trace(_gpt(), _layout(schedule)).stages
        errors = [t / m - 1 for t, m in zip(traced, measured[schedule], strict=True)]
        assert all(abs(e) <= 0.05 for e in errors), (schedule, traced, measured[schedule])
    # traced as 1F1B (one stage a rank, whole backwards), as before: far below both ranks
    one_stage = trace(_gpt(), dataclasses.replace(_layout("zbv"), schedule="1f1b")).stages
    assert all(t < 0.9 * m for t, m in zip(one_stage, measured["zbv"], strict=True))


@pytest.mark.heavy
def test_on_4_ranks_the_traced_ranks_are_within_5_percent_and_the_middle_ones_lighter() -> None:
    """pp 4, 8 blocks, 8 micro-batches of 1 row: ranks 0 and 3 are traced (the V turns at
    rank 3 under zbv and dualpipev); ranks 1 and 2 hold no more than the worse of them."""
    per_rank = run_distributed(_rank, 4, 8, 8, timeout=400)
    for schedule, measured in zip(SCHEDULES, zip(*per_rank, strict=True), strict=True):
        traced = trace(_gpt(8), _layout(schedule, pp=4, chunks=8))
        first, last = traced.stages
        assert abs(first / measured[0] - 1) <= 0.05, (schedule, traced.stages, measured)
        assert abs(last / measured[3] - 1) <= 0.05, (schedule, traced.stages, measured)
        assert max(measured[1:3]) <= max(measured[0], measured[3]), (schedule, measured)
