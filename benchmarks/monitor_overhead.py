"""What run-health monitoring costs per step: monitoring at its defaults (A) against every
switchable part off (B), interleaved A B A B, reported as a ratio of step times.

    .venv/bin/python benchmarks/monitor_overhead.py [--mode blocks|runs|check] [--steps 600]
        [--size tiny|small] [--pairs 6] [--out results.json]

A, the defaults: the straggler check (an all-gather of 3 floats per rank every
``monitor.straggler_every`` = 20 steps and a JSON line) and the hang watchdog (a deadline reset
per step under a lock; a daemon thread polling). B: ``monitor.straggler_every = 0``,
``monitor.step_timeout_s = 0``. What cannot be switched off runs in both: the breakdown timers
(a few ``perf_counter`` calls per step) and the numerics guard, which is also the loss
all-reduce the metrics need anyway (benchmarks/overhead.py measures meshrun against a
hand-written loop).

``--mode blocks`` (default): one 2-process training run of the demo GPT that switches between
A and B every 20 optimizer steps (the same step on every rank: the check is a collective), so
both see the same machine at nearly the same time. A block holds exactly one straggler check,
the default density. A step's bookkeeping lands in the *next* step's time (the loop measures
from the end of one ``optimizer_step`` to the end of the next), so block k is steps
20k+2 .. 20k+21. Per block: mean step time (a mean, since the check is one step in 20); per
adjacent A/B pair, the ratio A/B; the result is the median over pairs. Also: ``loop_s`` (meshrun's
own time between steps, where the check and the watchdog reset run), A minus B per pair, as a
share of B's step time: the direct figure.

``--mode check``: the parts on their own, in 2 processes lined up by a barrier before each call
(so no rank waits for a slower one): the straggler check's all-gather and comparison, and the
watchdog's reset; per call and per step.

``--mode runs``: separate ``meshrun launch`` runs of the demo, A B A B ..., median step time per
run, ratio per pair, median over pairs. Each run is its own process start: on a shared machine
the run-to-run noise dwarfs the effect (see docs/monitor.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BLOCK = 20  # steps per A or B block = the default straggler_every
OFF = ["--monitor.straggler_every=0", "--monitor.step_timeout_s=0"]


# --- worker (--mode blocks): one training run switching A/B every BLOCK steps ---------------


def worker(a: argparse.Namespace) -> None:
    import dataclasses

    import torch

    import meshrun
    from meshrun.demo.corpus import build_demo_datasets
    from meshrun.demo.model import GPT, demo_config

    run = meshrun.init(
        argv=[
            f"--job.run_dir={a.run_dir}",
            f"--optim.steps={a.steps}",
            "--metrics.progress=false",
            "--data.global_batch=32",
            "--data.micro_batch=8",
        ]
    )
    cfg = demo_config(a.size)
    model = run.parallelize(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=run.scaled_lr())
    train, _ = build_demo_datasets(cfg.seq_len, limit_bytes=a.corpus_bytes)
    monitor = run._parts.monitor
    on, timeout = monitor.settings, monitor.watchdog.timeout_s
    off = dataclasses.replace(on, straggler_every=0, step_timeout_s=0.0)
    for batch in run.steps(run.dataloader(train)):
        run.backward(model(batch["input"], batch["target"]))
        if run.optimizer_step(opt) and run.step % BLOCK == 0:
            monitoring = (run.step // BLOCK) % 2 == 0  # steps 1-20 on, 21-40 off, ...
            monitor.settings = on if monitoring else off
            monitor.watchdog.timeout_s = timeout if monitoring else 0.0
            if not monitoring:
                monitor.watchdog.disarm()
    run.close()


def worker_check(a: argparse.Namespace) -> None:
    """``--mode check``: the monitoring's per-call costs on their own, ranks lined up by a
    barrier first (so no rank waits for a slower one): the straggler check's all-gather + the
    comparison, and the watchdog's per-step reset."""
    import torch
    import torch.distributed as dist

    from meshrun.monitor.stragglers import find_stragglers, gather_components
    from meshrun.monitor.watchdog import Watchdog

    dist.init_process_group("gloo")
    window = {"step_time_s": 1.0, "data_wait_s": 0.1, "own_s": 0.5}
    hosts = ["h"] * dist.get_world_size()
    check, beat = [], []
    dog = Watchdog(Path(a.run_dir), dist.get_rank(), dist.get_world_size(), 300.0)
    for i in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        per_rank = gather_components(window, torch.device("cpu"))
        find_stragglers(per_rank, hosts, i, BLOCK, 1.5, 0.005)
        t1 = time.perf_counter()
        dog.beat(i)
        beat.append(time.perf_counter() - t1)
        check.append(t1 - t0)
    dog.disarm()
    if dist.get_rank() == 0:
        result = {
            "check_median_s": statistics.median(check),
            "beat_median_s": statistics.median(beat),
        }
        Path(a.run_dir, "check.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def analyse_blocks(rows: list[dict[str, Any]], skip_blocks: int) -> dict[str, Any]:
    """Per adjacent (A, B) block pair: mean step time ratio and loop_s difference."""
    blocks: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        blocks.setdefault((r["step"] - 2) // BLOCK, []).append(r)
    pairs = []
    for k in range(skip_blocks, max(blocks) + 1, 2):  # even blocks are A (monitoring on)
        a, b = blocks.get(k, []), blocks.get(k + 1, [])
        if len(a) < BLOCK or len(b) < BLOCK:
            continue
        step_a = statistics.fmean(r["step_time_s"] for r in a)
        step_b = statistics.fmean(r["step_time_s"] for r in b)
        loop_a = statistics.fmean(r["loop_s"] for r in a)
        loop_b = statistics.fmean(r["loop_s"] for r in b)
        pairs.append(
            {
                "a_ms": step_a * 1e3,
                "b_ms": step_b * 1e3,
                "ratio": step_a / step_b,
                "loop_extra_share": (loop_a - loop_b) / step_b,
            }
        )
    return {"pairs": pairs}


def start_workers(a: argparse.Namespace, run_dir: Path, mode: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(a.nproc),
        __file__,
        "--worker",
        mode,
        "--run-dir",
        str(run_dir),
        "--steps",
        str(a.steps),
        "--size",
        a.size,
        "--corpus-bytes",
        str(a.corpus_bytes),
    ]
    env = {k: v for k, v in os.environ.items() if k != "MESHRUN_CONFIG"}
    env.setdefault("OMP_NUM_THREADS", "1")
    run_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def run_check(a: argparse.Namespace, root: Path) -> dict[str, Any]:
    start_workers(a, root, "check")
    result: dict[str, Any] = json.loads((root / "check.json").read_text())
    print(
        f"straggler check (all-gather + comparison): median {result['check_median_s'] * 1e6:.0f}"
        f" us per call = {result['check_median_s'] / BLOCK * 1e6:.1f} us per step at "
        f"straggler_every={BLOCK}; watchdog reset: median {result['beat_median_s'] * 1e6:.1f} us"
        " per step"
    )
    return result


def run_blocks(a: argparse.Namespace, root: Path) -> dict[str, Any]:
    run_dir = root / "blocks"
    load = os.getloadavg()[0]
    start_workers(a, run_dir, "train")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "event" not in r]
    result = analyse_blocks(rows, skip_blocks=2)  # the first 40 steps: warm-up
    for i, p in enumerate(result["pairs"]):
        print(
            f"blocks {i}: A {p['a_ms']:.2f} ms/step | B {p['b_ms']:.2f} ms/step | A/B "
            f"{p['ratio']:.4f} | loop_s A-B {100 * p['loop_extra_share']:+.3f}% of the step"
        )
    result["load_before"] = load
    return result


# --- separate runs (--mode runs) -------------------------------------------------------------


def run_once(run_dir: Path, a: argparse.Namespace, monitor_on: bool) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "meshrun",
        "launch",
        "--nproc-per-node",
        str(a.nproc),
        "-m",
        "meshrun.demo",
        "--size",
        a.size,
        "--steps",
        str(a.steps),
        "--corpus-bytes",
        str(a.corpus_bytes),
        f"--job.run_dir={run_dir}",
        "--metrics.progress=false",
        *([] if monitor_on else OFF),
    ]
    env = {k: v for k, v in os.environ.items() if k != "MESHRUN_CONFIG"}
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r and r["step"] > 10]
    return {
        "load_before": load,
        "wall_s": time.monotonic() - t0,
        "median_step_s": statistics.median(r["step_time_s"] for r in steps),
        # Mean, not median: the straggler check runs on one step in 20 and lands in loop_s.
        "mean_loop_s": statistics.fmean(r["loop_s"] for r in steps),
    }


def run_pairs(a: argparse.Namespace, root: Path) -> dict[str, Any]:
    pairs = []
    for i in range(a.pairs):
        on = run_once(root / f"pair{i}-on", a, monitor_on=True)
        off = run_once(root / f"pair{i}-off", a, monitor_on=False)
        ratio = on["median_step_s"] / off["median_step_s"]
        extra = (on["mean_loop_s"] - off["mean_loop_s"]) / off["median_step_s"]
        pairs.append(
            {
                "a_ms": on["median_step_s"] * 1e3,
                "b_ms": off["median_step_s"] * 1e3,
                "ratio": ratio,
                "loop_extra_share": extra,
            }
        )
        print(
            f"runs {i}: A {on['median_step_s'] * 1e3:.2f} ms/step (load {on['load_before']:.1f})"
            f" | B {off['median_step_s'] * 1e3:.2f} ms/step (load {off['load_before']:.1f}) | "
            f"A/B {ratio:.4f} | loop_s A-B {100 * extra:+.3f}% of the step",
            flush=True,
        )
    return {"pairs": pairs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["blocks", "runs", "check"], default="blocks")
    p.add_argument(
        "--steps",
        type=int,
        help="optimizer steps or calls (default: blocks 600, runs 150, check 500)",
    )
    p.add_argument("--pairs", type=int, default=6, help="--mode runs: A/B pairs of runs")
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--corpus-bytes", type=int, default=400_000)
    p.add_argument("--out", help="write every figure as JSON")
    p.add_argument("--worker", choices=["train", "check"], help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        import meshrun

        # @meshrun.main's clean exit: a Gloo worker can abort in interpreter teardown.
        meshrun.main(worker if a.worker == "train" else worker_check)(a)
        return
    a.steps = a.steps or {"blocks": 600, "runs": 150, "check": 500}[a.mode]
    with tempfile.TemporaryDirectory(prefix="monitor-overhead-") as tmp:
        if a.mode == "check":
            result = run_check(a, Path(tmp))
            if a.out:
                Path(a.out).write_text(json.dumps(result, indent=1))
            return
        result = (run_blocks if a.mode == "blocks" else run_pairs)(a, Path(tmp))
    ratios = [x["ratio"] for x in result["pairs"]]
    extras = [x["loop_extra_share"] for x in result["pairs"]]
    summary = {
        "mode": a.mode,
        "pairs": len(ratios),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "loop_extra_share_median": statistics.median(extras),
    }
    print(
        f"monitoring on/off ({a.mode}): step-time ratio A/B median {summary['ratio_median']:.4f} "
        f"over {len(ratios)} pairs (min {min(ratios):.4f}, max {max(ratios):.4f}); loop_s A-B: "
        f"median {100 * summary['loop_extra_share_median']:+.3f}% of the step"
    )
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, **result}, indent=1))


if __name__ == "__main__":
    main()
