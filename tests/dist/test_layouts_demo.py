"""The demo runs under every layout of docs/parallel.md's table through command-line overrides,
the way a user runs it (`meshrun launch --nproc-per-node 4 -m meshrun.demo --parallel.pp=2
--parallel.zero=1 ...`, the module `meshrun demo` runs), and
trains like one process: the same per-step losses and the same exact validation loss before
and after the steps (over the same windows on every layout).

The layouts here are the ones the demo's loop treats differently: ZeRO-1 (the optimizer from
``run.optimizer``), and pipeline parallel (``run.pipeline`` / ``run.pipeline_step``, evaluation
through the schedule's forward-only pass) composed with DDP, ZeRO-1, FSDP2 and TP + loss
parallel; FSDP 2 x TP 2 with loss parallel checks the start-up report as well. DDP, ZeRO-2/3,
HSDP and TP alone go through the loop's plain path, whose numerics tests/dist/test_layouts.py
checks layout by layout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS = 2
# Pinned, so that every world size and layout trains on the same samples per step as one
# process: 32 = 4 x accumulation x data-parallel size for dp = 1, 2 and 4.
BATCH = ["--data.global_batch=32", "--data.micro_batch=4"]
CORPUS = ["--corpus-bytes", "300000"]  # 160 validation windows
VAL = re.compile(rf"validation loss \(exact, \d+ windows\): step 0 [\d.]+ -> step {STEPS} [\d.]+")


def demo(run_dir: Path, nproc: int, *overrides: str) -> tuple[str, list[float], list[float]]:
    """Run the demo (tiny, STEPS steps) as `meshrun launch --nproc-per-node N -m meshrun.demo`
    (`meshrun demo` runs the same module; launch passes --corpus-bytes, and 300 kB keep the
    two validation passes short); return its output, the per-step losses from metrics.jsonl
    and the [start, end] validation losses."""
    env = {k: v for k, v in os.environ.items() if k != "MESHRUN_CONFIG"}
    env["OMP_NUM_THREADS"] = "1"
    demo = ["-m", "meshrun.demo", "--steps", str(STEPS), "--size", "tiny", *CORPUS]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshrun",
            "launch",
            "--nproc-per-node",
            str(nproc),
            *demo,
            *BATCH,
            *overrides,
            f"--job.run_dir={run_dir}",
        ],
        cwd=run_dir.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "event" not in r]
    evals = [r for r in rows if r.get("event") == "eval"]  # the exact figures of the printed line
    assert [r["at_step"] for r in evals] == [0, STEPS], evals
    assert VAL.search(out), out[-3000:]
    assert (run_dir / "checkpoints" / f"step_{STEPS:08d}").is_dir()
    return out, losses, [r["val_loss"] for r in evals]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], list[float]]:
    _, losses, val = demo(tmp_path_factory.mktemp("ref") / "run", 1)
    assert len(losses) == STEPS and all(5.0 < x < 6.0 for x in losses), losses  # ~ln(257)
    assert val[1] < val[0]  # two steps already lower the validation loss
    return losses, val


def assert_like_one_process(
    name: str, got: tuple[list[float], list[float]], ref: tuple[list[float], list[float]]
) -> None:
    (losses, val), (ref_losses, ref_val) = got, ref
    diffs = [abs(a - b) for a, b in zip([*losses, *val], [*ref_losses, *ref_val], strict=True)]
    print(f"{name}: losses {losses} val {val}; max difference to one process {max(diffs):.2g}")
    assert len(losses) == STEPS
    assert max(diffs) <= 2e-5, (name, losses, val, ref_losses, ref_val)


def state_table(out: str, ranks: int) -> list[tuple[float, float, float]]:
    """(params, grads, optimizer) MiB of each rank, from the start-up report's table."""
    table = out[out.index("model state per rank after the first step") :].splitlines()[2:]
    cells = [line.split()[-5:] for line in table[:ranks]]  # after the "[default0]:" prefix
    assert [c[0] for c in cells] == [str(r) for r in range(ranks)], table
    return [(float(c[-3]), float(c[-2]), float(c[-1])) for c in cells]


PIPELINE = "pipeline: 1 stage(s) on this rank of 2, schedule 1f1b"
# name: (processes, overrides, a line of the start-up output that shows the layout ran, AdamW's
# state over the parameters, summed over ranks: 2 buffers, or 1 where ZeRO-1 splits them
# over the dp = 2 ranks that each hold the whole parameters)
LAYOUTS = {
    "zero1": (2, ["--parallel.zero=1"], "ZeRO-1", 1.0),
    # Context parallel: each rank its half of every window, attention by all-to-all.
    "cp2": (2, ["--parallel.cp=2"], "context parallel over 2 ranks: 2 attention modules", 2.0),
    "pp2_zero0": (4, ["--parallel.pp=2", "--parallel.zero=0"], PIPELINE, 2.0),
    "pp2_zero1": (4, ["--parallel.pp=2", "--parallel.zero=1"], PIPELINE, 1.0),
    "pp2_zero3": (4, ["--parallel.pp=2", "--parallel.zero=3"], PIPELINE, 2.0),
    "pp2_tp2": (
        4,
        ["--parallel.pp=2", "--parallel.tp=2", "--parallel.loss_parallel=true"],
        "tensor parallel over 2 ranks",
        2.0,
    ),
}


# heavy: zero1, pp2_zero0, pp2_zero3, pp2_tp2; [pp2_zero1] stays (pipeline + run.optimizer branch)
# fsdp2_x_tp2 below (loss parallel); the pipeline layouts'
# numerics run in CI in test_layouts_pp.py and test_pp_zero1.py.
# cp2 too (CI's time): context parallel's training and refusals run in CI in test_cp.py.
HEAVY_LAYOUTS = ("zero1", "cp2", "pp2_zero0", "pp2_zero3", "pp2_tp2")


@pytest.mark.timeout(600)  # with the one-process reference on the first call; 2 busy cores
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.heavy) if n in HEAVY_LAYOUTS else n for n in LAYOUTS],
)
def test_demo_runs_like_one_process_under(
    name: str, tmp_path: Path, one_process: tuple[list[float], list[float]]
) -> None:
    nproc, overrides, shown, optim_ratio = LAYOUTS[name]
    out, losses, val = demo(tmp_path / "run", nproc, *overrides)
    assert shown in out, out[-3000:]
    assert (PIPELINE in out) == name.startswith("pp"), out[-3000:]
    rows = state_table(out, nproc)
    assert all(grads == params for params, grads, _ in rows), (name, rows)
    # Summed over ranks: ZeRO's partition of the parameters over ranks need not be even.
    ratio = sum(r[2] for r in rows) / sum(r[0] for r in rows)
    assert abs(ratio - optim_ratio) < 0.05, (name, rows)
    assert_like_one_process(name, (losses, val), one_process)


@pytest.mark.timeout(600)
def test_demo_runs_fsdp2_x_tp2_from_overrides(
    tmp_path: Path, one_process: tuple[list[float], list[float]]
) -> None:
    run_dir = tmp_path / "run"
    args = ["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.loss_parallel=true"]
    out, losses, val = demo(run_dir, 4, *args)  # loss parallel: the head split over the vocab
    assert "mesh dp_shard=2 x tp=2" in out
    assert "tensor parallel over 2 ranks: 13 modules split (+ loss parallel)" in out
    assert "FSDP2 ZeRO-3 over pp=1 x dp_replicate=1 x dp_shard=2 x tp=2" in out
    # Placement: tp pairs neighbouring ranks (inside a node), dp_shard strides over them.
    assert "rank groups: dp_shard: [0, 2] [1, 3] | tp: [0, 1] [2, 3]" in out
    # Block matmuls and (loss parallel) the head over 4 ranks, embeddings and norms over 2.
    assert "this rank holds 0.15 MiB of 0.51 MiB parameters" in out
    # After the first step, every rank's measured bytes: the same split on each of the 4 ranks,
    # gradients as the parameters, AdamW's two buffers twice the parameters (2-digit MiB).
    for params, grads, optim in state_table(out, 4):
        assert params == 0.15 and grads == params and abs(optim - 2 * params) <= 0.02, out
    warned = (run_dir / "logs" / "rank0.log").read_text()
    assert "parallel.zero = 0 (DDP) cannot take tensor-parallel parameters" in warned
    assert_like_one_process("fsdp2_x_tp2", (losses, val), one_process)
