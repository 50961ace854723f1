"""Exposed communication measured by the profiler on sampled steps (monitor/comm_profile.py),
for the layouts DDP's comm hook cannot time, in one real 2-rank Gloo world (process starts
are expensive): ZeRO-3 (FSDP2), then TP 2, then PP 2 (1F1B), each a fresh mesh and model
driven by meshrun's step loop (what ``run.steps``/``run.backward``/``run.optimizer_step`` do),
with ``monitor.comm_sample_every = 2``.

ZeRO-3 also gets known extra communication: from step INJECT_FROM on, every sampled step's
forward does one more all-reduce that rank 1 enters INJECT_S late (the test's injection, not
product code), so rank 0 waits INJECT_S in it: its comm_exposed_s must grow by about that.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_layouts import build_model, loss_of
from test_layouts_pp import lm_loss

from _dist import run_distributed
from meshrun.config import Config, MonitorConfig, ParallelConfig, check_layout
from meshrun.parallel import parallelize, parallelize_pipeline, pipeline_step
from meshrun.runtime.launcher_env import LauncherEnv
from meshrun.runtime.mesh import ParallelDims, build_mesh
from meshrun.train.loop import StepLoop
from meshrun.train.startup import build_machinery

EVERY = 2
STEPS = 8  # TP and PP
Z3_STEPS, INJECT_FROM = 14, 9  # ZeRO-3: sampled steps 2..8 plain, 10..14 with the injection
INJECT_S = 0.2  # large against the run-to-run spread of the plain exposed time (10-60 ms)
MICRO = 4
CPU = torch.device("cpu")
PARTS = ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "sync_s", "loop_s")


def make_loop(rank: int, run_dir: str, steps: int, dp: int) -> StepLoop:
    """The step loop as meshrun.init builds it, over no mesh (the test's layout is its own)."""
    cfg = Config()
    cfg.optim.steps, cfg.optim.grad_clip = steps, 1.0
    cfg.metrics.log_every, cfg.metrics.progress = 1, False
    cfg.data.micro_batch, cfg.data.global_batch = MICRO, MICRO * dp
    cfg.monitor = MonitorConfig(comm_sample_every=EVERY, straggler_every=0, step_timeout_s=0)
    env = LauncherEnv("torchelastic", rank, 2, rank, 2, 0, "127.0.0.1", 0, "localhost")
    return StepLoop(build_machinery(cfg, Path(run_dir), 1, CPU, None, env))


def batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 16, (MICRO, 33), generator=g) for _ in range(steps)]


def mesh_of(layout: dict[str, Any]) -> tuple[ParallelConfig, Any, ParallelDims]:
    cfg = ParallelConfig(**layout)
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    check_layout(cfg, vars(dims))
    return cfg, build_mesh(dims, "cpu"), dims


def train(rank: int, layout: dict[str, Any], run_dir: str, steps: int, inject: bool) -> None:
    cfg, mesh, dims = mesh_of(layout)
    model = parallelize(build_model(), mesh, cfg, CPU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = make_loop(rank, run_dir, steps, dims.dp)
    loop.parts.state.models.append(model)
    for tokens in loop.steps(batches(steps)):
        step = loop.parts.state.step + 1
        loss = loss_of(model, tokens)
        if inject and step >= INJECT_FROM and step % EVERY == 0:
            if rank == 1:
                time.sleep(INJECT_S)
            dist.all_reduce(torch.ones(1))  # rank 0 waits INJECT_S in here
        loop.backward(loss)
        loop.optimizer_step(opt)
    loop.parts.metrics.close()


def train_pp(rank: int, run_dir: str) -> None:
    cfg, mesh, dims = mesh_of({"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 2})
    pipe = parallelize_pipeline(build_model(n_layer=4), mesh, cfg, CPU, lm_loss)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    loop = make_loop(rank, run_dir, STEPS, dims.dp)
    loop.parts.state.models.extend(pipe.modules)
    loop.parts.state.pp_group = pipe.group
    for tokens in loop.steps(batches(STEPS)):
        loop.record_loss(pipeline_step(pipe, tokens[:, :-1], tokens[:, 1:]))
        loop.optimizer_step(opt)
    loop.parts.metrics.close()


def world(rank: int, world_size: int, base: str) -> None:
    dist.init_process_group("gloo")
    train(rank, {"zero": 3}, f"{base}/zero3", Z3_STEPS, inject=True)
    train(rank, {"tp": 2}, f"{base}/tp", STEPS, inject=False)
    train_pp(rank, f"{base}/pp")


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "step" in x and "event" not in x]


def sampled(rows: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The sampled steps (every EVERY-th, not the first); the others carry no comm figures."""
    got = [r for r in rows if r.get("comm_method") == "profiler_sampled"]
    assert [r["step"] for r in got] == [s for s in range(2, len(rows) + 1, EVERY)], name
    assert all("comm_exposed_s" not in r for r in rows if r["step"] % EVERY), name
    for r in got:
        assert 0 < r["comm_exposed_s"] <= r["step_time_s"], (name, r)
        assert r["comm_exposed_s"] <= r["comm_s"] + 1e-9, (name, r)
    print(
        f"{name}: sampled steps {[r['step'] for r in got]}: comm_exposed_s (ms)",
        [round(1e3 * r["comm_exposed_s"], 2) for r in got],
        "comm_s (ms)",
        [round(1e3 * r["comm_s"], 2) for r in got],
        "step (ms)",
        [round(1e3 * r["step_time_s"], 1) for r in got],
    )
    return got


@pytest.mark.timeout(240)
def test_sampled_exposed_comm_under_zero3_tp_and_pp(tmp_path: Path) -> None:
    run_distributed(world, 2, str(tmp_path), timeout=200)

    z3_rows = step_rows(tmp_path / "zero3")
    z3 = sampled(z3_rows, "ZeRO-3")
    # The breakdown still adds up on sampled steps (the profiler's start is in loop_s).
    ratios = [sum(r[p] for p in PARTS) / r["step_time_s"] for r in z3_rows if r["step"] > 1]
    print(f"ZeRO-3 breakdown / step time: median {statistics.median(ratios):.4f}")
    assert 0.95 <= statistics.median(ratios) <= 1.0 + 1e-9
    # Sampled steps too (a profiler start left out of loop_s would lower every one of them);
    # their median, not each step: one step descheduled between two phase timers on a busy
    # machine loses a few ms that no part holds (0.935 seen once with two test files running).
    sampled_ratios = [sum(r[p] for p in PARTS) / r["step_time_s"] for r in z3]
    assert statistics.median(sampled_ratios) >= 0.95, sampled_ratios
    # Known extra communication: rank 0's exposed time grows by about INJECT_S.
    plain = statistics.median(r["comm_exposed_s"] for r in z3 if r["step"] < INJECT_FROM)
    more = statistics.median(r["comm_exposed_s"] for r in z3 if r["step"] >= INJECT_FROM)
    print(f"ZeRO-3 injected {1e3 * INJECT_S:.0f} ms: exposed grew by {1e3 * (more - plain):.1f} ms")
    assert abs((more - plain) - INJECT_S) <= 0.3 * INJECT_S
    sampled(step_rows(tmp_path / "tp"), "TP 2")
    sampled(step_rows(tmp_path / "pp"), "PP 2")
    summary = json.loads((tmp_path / "zero3" / "metrics.jsonl").read_text().splitlines()[-1])
    assert summary["event"] == "summary" and 0 < summary["comm_exposed_share"] <= 1, summary
