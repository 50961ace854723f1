"""The start-up layout line says what each data-parallel rank holds: DDP replicates (it never
says shards for DDP), ZeRO-1 shards the optimizer state, FSDP2 shards all three."""

import pytest

from meshrun.config import ParallelConfig
from meshrun.parallel.report import layout_header
from meshrun.runtime.mesh import ParallelDims


def test_ddp_is_described_as_replicated() -> None:
    line = layout_header(ParallelDims(1, 1, 2, 1), ParallelConfig(), 0)
    assert line.startswith("layout: pp=1 x dp=2 (replicated) x tp=1 | ZeRO-0 = DDP over 2 ranks")
    assert "each holds a whole replica" in line
    assert "dp_shard" not in line and "shard" not in line


@pytest.mark.parametrize(
    ("zero", "words"),
    [
        (
            1,
            "DDP + ZeRO-1 over 4 ranks: parameters and gradients replicated, optimizer state sharded",
        ),
        (
            2,
            "FSDP2 over 4 ranks: parameters, gradients and optimizer state sharded (parameters stay",
        ),
        (3, "FSDP2 over 4 ranks: parameters, gradients and optimizer state sharded |"),
    ],
)
def test_each_zero_stage_says_what_is_sharded(zero: int, words: str) -> None:
    assert words in layout_header(ParallelDims(1, 1, 4, 1), ParallelConfig(), zero)


def test_one_process_names_no_technique() -> None:
    line = layout_header(ParallelDims(1, 1, 1, 1), ParallelConfig(), 0)
    assert line.startswith("layout: pp=1 x dp_replicate=1 x dp_shard=1 x tp=1 | ZeRO-0 | params")
