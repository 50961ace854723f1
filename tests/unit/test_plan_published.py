"""The planner's time model against peers' published throughput (docs/plan.md, "Published
throughput"). Each row is a run a peer published with its whole setup (model shape, GPUs,
layout, micro-batch, activation checkpointing, precision); `meshrun plan --layout ...` runs
with its default, uncalibrated efficiencies, and the docs' table must show the figure it
prints now: the predicted tokens/s per GPU and the error against the published one. A row
more than 15 % off must say why in the table."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from doc_tables import row_problems, table_rows
from meshrun.cli.main import main

WITHIN = 0.15


def _mpt(hidden: int, layers: int, heads: int) -> list[str]:
    """An MPT model of llm-foundry's yamls: GELU MLP of 4 x hidden, vocab 50,368, seq 2,048."""
    shape = {"layers": layers, "hidden": hidden, "heads": heads, "vocab": 50368, "seq": 2048}
    return [*(x for k, v in shape.items() for x in (f"--{k}", str(v))), "--mlp", "plain"]


_LLAMA3_8B = [
    "--layers",
    "32",
    "--hidden",
    "4096",
    "--heads",
    "32",
    "--kv-heads",
    "8",
    "--ffn",
    "14336",
    "--vocab",
    "128256",
    "--seq",
    "8192",
    "--mlp",
    "gated",
]
_LLAMA3_70B = [
    "--layers",
    "80",
    "--hidden",
    "8192",
    "--heads",
    "64",
    "--kv-heads",
    "8",
    "--ffn",
    "28672",
    "--vocab",
    "128256",
    "--seq",
    "8192",
    "--mlp",
    "gated",
]


@dataclass(frozen=True)
class Row:
    name: str  # the first cell of the docs' row
    shape: list[str]
    gpus: int
    global_batch: int
    layout: str
    published: float  # tokens/s per GPU


ROWS = [
    Row(
        "MPT-1b",
        _mpt(2048, 24, 16),
        8,
        112,
        "dp_shard=8,zero=3,micro_batch=14,activation_checkpointing=none",
        45455,
    ),
    Row(
        "MPT-3b",
        _mpt(2560, 32, 32),
        64,
        1152,
        "dp_shard=64,zero=3,micro_batch=6,activation_checkpointing=none",
        22525,
    ),
    Row(
        "MPT-7b",
        _mpt(4096, 32, 32),
        8,
        48,
        "dp_shard=8,zero=3,micro_batch=6,activation_checkpointing=none",
        10643,
    ),
    Row(
        "MPT-13b",
        _mpt(5120, 40, 40),
        8,
        16,
        "dp_shard=8,zero=3,micro_batch=2,activation_checkpointing=none",
        4792,
    ),
    Row(
        "MPT-30b",
        _mpt(7168, 48, 64),
        16,
        480,
        "dp_shard=16,zero=3,micro_batch=10,activation_checkpointing=full",
        2263,
    ),
    Row(
        "MPT-70b",
        _mpt(8192, 80, 64),
        64,
        2048,
        "dp_shard=64,zero=3,micro_batch=8,activation_checkpointing=full",
        1039,
    ),
    Row(
        "Llama-3.1-8B FSDP 8",
        _LLAMA3_8B,
        8,
        16,
        "dp_shard=8,zero=3,micro_batch=2,activation_checkpointing=selective",
        5762,
    ),
    Row(
        "Llama-3.1-8B FSDP 128",
        _LLAMA3_8B,
        128,
        256,
        "dp_shard=128,zero=3,micro_batch=2,activation_checkpointing=selective",
        5605,
    ),
    Row(
        "Llama-3-8B FSDP 8 x TP 8",
        _LLAMA3_8B,
        64,
        96,
        "dp_shard=8,zero=3,tp=8,micro_batch=12,activation_checkpointing=selective",
        4378,
    ),
    Row(
        "Llama-3-70B FSDP 32 x TP 8",
        _LLAMA3_70B,
        256,
        512,
        "dp_shard=32,zero=3,tp=8,micro_batch=16,activation_checkpointing=full",
        597.3,
    ),
]


def predicted_per_gpu(row: Row, capsys: pytest.CaptureFixture[str]) -> float:
    """What `meshrun plan --layout ... --json` predicts, tokens/s per GPU."""
    argv = [
        "plan",
        *row.shape,
        "--global-batch",
        str(row.global_batch),
        "--precision",
        "bf16",
        "--gpu",
        "h100-sxm",
        "--nodes",
        str(row.gpus // 8),
        "--layout",
        row.layout,
        "--json",
    ]
    capsys.readouterr()
    assert main(argv) == 0
    (layout,) = json.loads(capsys.readouterr().out)["layouts"]
    return float(layout["tokens_per_s"]) / row.gpus


def doc_rows(text: str | None = None) -> dict[str, list[str]]:
    return table_rows("## Published throughput", text)


def problems(row: Row, cells: list[str] | None, now: float) -> list[str]:
    return row_problems(
        row.name, cells, row.published, now, table="published-throughput table", within=WITHIN
    )


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_the_docs_table_shows_what_the_planner_predicts_now(
    row: Row, capsys: pytest.CaptureFixture[str]
) -> None:
    now = predicted_per_gpu(row, capsys)
    assert not problems(row, doc_rows().get(row.name), now)


def test_a_stale_prediction_or_a_missing_reason_is_caught(
    capsys: pytest.CaptureFixture[str],
) -> None:
    row = next(r for r in ROWS if r.name == "MPT-13b")
    now = predicted_per_gpu(row, capsys)
    assert abs(now / row.published - 1) > WITHIN  # the row the planted docs break
    cells = doc_rows()[row.name]
    stale = [*cells[:4], f"{now * 1.1:,.0f}", *cells[5:]]
    assert any("the planner prints" in p for p in problems(row, stale, now))
    no_reason = [*cells[:6], "-"]
    assert problems(row, no_reason, now) == [
        f"{100 * (now / row.published - 1):+.1f} % off and no reason given"
    ]
