"""What sampling exposed communication with the profiler costs, and how it compares with DDP's
comm-hook figure (monitor/comm_profile.py, docs/monitor.md).

    .venv/bin/python benchmarks/comm_sampled.py [--steps 200] [--size tiny|small] [--out r.json]

Two 2-process runs of the demo GPT through torchrun:

1. ZeRO-3 with ``monitor.comm_sample_every = 4``: steps 4, 8, ... run under the profiler.
   The profiler's start is in the sampled step, its stop and the analysis in the next step's
   ``loop_s``, so the cost of one sample is (t[k] + t[k+1]) - (t[k+2] + t[k+3]) for sampled k,
   interleaved A B A B along one run; the median over pairs is the cost per sample, and the
   overhead at the default sampling is that over ``comm_sample_every`` (default) plain steps.
2. DDP (its comm hook times every step) with the profiler also forced on every 4th step: on
   the same steps, the hook's ``comm_exposed_s`` and the profiler's, side by side: the two
   methods' disagreement is an estimate of the profiler method's error.
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

EVERY = 4


def worker(a: argparse.Namespace) -> None:
    import torch

    import meshrun
    from meshrun.demo.corpus import build_demo_datasets
    from meshrun.demo.model import GPT, demo_config

    run = meshrun.init(
        argv=[
            f"--job.run_dir={a.run_dir}",
            f"--optim.steps={a.steps}",
            "--metrics.progress=false",
            "--data.global_batch=16",
            "--data.micro_batch=8",
            f"--parallel.zero={3 if a.layout == 'zero3' else 0}",
            f"--monitor.comm_sample_every={EVERY}",
            "--monitor.straggler_every=0",
        ]
    )
    cfg = demo_config(a.size)
    model = run.parallelize(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=run.scaled_lr())
    train, _ = build_demo_datasets(cfg.seq_len, limit_bytes=a.corpus_bytes)
    sampler = run._parts.monitor.sampler
    profiled: dict[int, Any] = {}
    calls: dict[str, list[float]] = {"start_s": [], "stop_s": []}
    start, stop = sampler.start, sampler.stop

    def timed_start() -> None:
        t0 = time.perf_counter()
        start()
        calls["start_s"].append(time.perf_counter() - t0)

    def keep() -> dict[str, float | str]:  # DDP: the hook's figure wins the line; keep ours
        t0 = time.perf_counter()
        out = stop()
        if out:
            calls["stop_s"].append(time.perf_counter() - t0)
            profiled[run.step + 1] = out
        return out

    sampler.start = timed_start  # type: ignore[method-assign]
    sampler.stop = keep  # type: ignore[method-assign]
    for batch in run.steps(run.dataloader(train)):
        if a.layout == "ddp" and (run.step + 1) % EVERY == 0:
            sampler.start()  # DDP's hook disables sampling: forced here, for the comparison
        run.backward(model(batch["input"], batch["target"]))
        run.optimizer_step(opt)
    if run.is_main:
        Path(a.run_dir, "profiled.json").write_text(json.dumps(profiled))
        medians = {k: statistics.median(v) for k, v in calls.items() if v}
        Path(a.run_dir, "calls.json").write_text(json.dumps(medians))
    run.close()


def start(a: argparse.Namespace, run_dir: Path, layout: str) -> list[dict[str, Any]]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        __file__,
        "--worker",
        layout,
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
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" not in r]


def cost(rows: list[dict[str, Any]], default_every: int) -> dict[str, Any]:
    t = {r["step"]: r["step_time_s"] for r in rows}
    pairs = []
    for k in range(2 * EVERY, max(t) - 3, EVERY):  # the first sample: warm-up
        if all(s in t for s in range(k, k + 4)):
            pairs.append((t[k] + t[k + 1] - t[k + 2] - t[k + 3], (t[k + 2] + t[k + 3]) / 2))
    extra = statistics.median(p[0] for p in pairs)
    plain = statistics.median(p[1] for p in pairs)
    spread = sorted(p[0] for p in pairs)
    return {
        "pairs": len(pairs),
        "extra_per_sample_s": extra,
        "plain_step_s": plain,
        "extra_quartiles_s": [spread[len(spread) // 4], spread[3 * len(spread) // 4]],
        "overhead_at_default": extra / (default_every * plain),
    }


def compare(rows: list[dict[str, Any]], profiled: dict[str, Any]) -> dict[str, Any]:
    hook = {r["step"]: r for r in rows if "comm_exposed_s" in r}
    both = [(hook[int(k)], v) for k, v in profiled.items() if int(k) in hook and int(k) > 1]
    diff = [p["comm_exposed_s"] - h["comm_exposed_s"] for h, p in both]
    return {
        "steps": len(both),
        "hook_exposed_ms": statistics.median(h["comm_exposed_s"] for h, _ in both) * 1e3,
        "profiler_exposed_ms": statistics.median(p["comm_exposed_s"] for _, p in both) * 1e3,
        "hook_comm_ms": statistics.median(h["comm_s"] for h, _ in both) * 1e3,
        "profiler_comm_ms": statistics.median(p["comm_s"] for _, p in both) * 1e3,
        "diff_median_ms": statistics.median(diff) * 1e3,
        "diff_abs_max_ms": max(abs(d) for d in diff) * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--size", default="tiny")
    p.add_argument("--corpus-bytes", type=int, default=400_000)
    p.add_argument("--out", default="")
    p.add_argument("--worker", default="")
    p.add_argument("--run-dir", default="")
    a = p.parse_args()
    if a.worker:
        a.layout = a.worker
        worker(a)
        return
    from meshrun.config import MonitorConfig

    default_every = MonitorConfig().comm_sample_every
    result: dict[str, Any] = {"load_before": os.getloadavg()[0], "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        z3 = start(a, Path(tmp, "zero3"), "zero3")
        result["zero3_cost"] = cost(z3, default_every)
        result["zero3_calls"] = json.loads(Path(tmp, "zero3", "calls.json").read_text())
        ddp_dir = Path(tmp, "ddp")
        ddp = start(a, ddp_dir, "ddp")
        result["ddp_hook_vs_profiler"] = compare(
            ddp, json.loads((ddp_dir / "profiled.json").read_text())
        )
    result["load_after"] = os.getloadavg()[0]
    c = result["zero3_cost"]
    print(
        f"ZeRO-3, {c['pairs']} pairs: a sample costs {1e3 * c['extra_per_sample_s']:.2f} ms "
        f"(quartiles {1e3 * c['extra_quartiles_s'][0]:.2f} .. {1e3 * c['extra_quartiles_s'][1]:.2f})"
        f" on a {1e3 * c['plain_step_s']:.1f} ms step: {100 * c['overhead_at_default']:.2f}% "
        f"at comm_sample_every={default_every}"
    )
    k = result["zero3_calls"]
    print(
        f"  of which profiler start {1e3 * k['start_s']:.2f} ms, stop + analysis "
        f"{1e3 * k['stop_s']:.2f} ms (medians, rank 0)"
    )
    d = result["ddp_hook_vs_profiler"]
    print(
        f"DDP, {d['steps']} steps: exposed hook {d['hook_exposed_ms']:.2f} ms vs profiler "
        f"{d['profiler_exposed_ms']:.2f} ms (median diff {d['diff_median_ms']:+.2f}, max |diff| "
        f"{d['diff_abs_max_ms']:.2f}); comm_s hook {d['hook_comm_ms']:.2f} vs profiler "
        f"{d['profiler_comm_ms']:.2f} ms"
    )
    print(f"load average {result['load_before']:.1f} before, {result['load_after']:.1f} after")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
