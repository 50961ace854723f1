"""What meshrun costs over a hand-written DDP loop, as ratios measured in one run.

Two workers train the demo GPT on the same data, from the same weights, with the same
optimizer, schedule, micro-batch and accumulation:

    A  overhead_plain.py    torch only: init_process_group("gloo"), DDP, no_sync(), AdamW
    B  overhead_meshrun.py  meshrun.init, run.parallelize/dataloader/steps/backward/optimizer_step

Both are started the same way, by the real torchrun agent
(``python -m torch.distributed.run --standalone --nproc-per-node N``, OMP_NUM_THREADS=1), in
interleaved pairs A B A B ... so that a machine getting slower or faster hits both alike.
Rank 0 of each writes a JSON with its per-step wall times (warm-up steps left out) and the
seconds from the moment this script started the launcher to the end of the first optimizer
step. Reported: the per-step ratio meshrun/plain (median over pairs of the ratio of each
pair's median step times), the same for CPU time per step, the startup ratio, the raw numbers
per pair and the final losses (equal when both trained the same thing).

Then (``--launch-pairs``, default 6; ``overhead_launch.py``) the launcher alone: ``torchrun``
against ``meshrun launch`` on a plain torch script, interleaved pairs, wall and CPU medians,
ratio and difference. Printed as (a); the startup ratio above is (b).

Separate runs are only as comparable as the machine is quiet: the load average before each
run is printed with it. ``overhead_breakdown.py`` measures meshrun's cost per step inside one
pair of processes, step by step interleaved, and each per-step extra on its own.

    .venv/bin/python benchmarks/overhead.py --repeats 3 [--steps 30 --size small --nproc 2]
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

from overhead_common import T0_ENV
from overhead_launch import launch_pairs, report_launch, summarize_launch

HERE = Path(__file__).resolve().parent
VARIANTS = ("plain", "meshrun")
TARGET_RATIO = 1.02
TARGET_STARTUP_DIFF_S = 0.25  # (b): meshrun's launch-to-first-step over the plain loop's
# The demo's settings (src/meshrun/demo/demo.toml), passed to both workers explicitly.
HYPER = {
    "global-batch": 32,
    "micro-batch": 4,
    "lr": 2e-3,
    "warmup-steps": 10,
    "min-lr-ratio": 0.1,
    "weight-decay": 0.1,
    "corpus-bytes": 4_000_000,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of step times")
    p.add_argument("--size", default="small", choices=["tiny", "small"], help="demo model size")
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks) per run")
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs (plain, meshrun)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per run")
    p.add_argument("--out", type=Path, help="also write the results here as JSON")
    p.add_argument("--keep", type=Path, help="keep run logs and results in this directory")
    p.add_argument(
        "--launch-pairs",
        type=int,
        default=6,
        help="then (a): pairs of torchrun / meshrun launch on a plain script (0: none)",
    )
    args = p.parse_args()
    if args.steps <= args.skip:
        p.error(f"--steps ({args.steps}) must be larger than --skip ({args.skip})")
    if HYPER["global-batch"] % (HYPER["micro-batch"] * args.nproc):
        p.error(
            f"global batch {HYPER['global-batch']} is not a multiple of micro-batch "
            f"{HYPER['micro-batch']} x --nproc {args.nproc}"
        )
    return args


def launch(variant: str, args: argparse.Namespace, workdir: Path, pair: int) -> dict[str, Any]:
    """One run through torchrun; returns rank 0's result record."""
    tag = f"{variant}_{pair}"
    result = workdir / f"{tag}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port of its own: never collides with other jobs
        "--nproc-per-node",
        str(args.nproc),
        str(HERE / f"overhead_{variant}.py"),
        f"--result={result}",
        f"--run-dir={workdir / tag}",
        f"--steps={args.steps}",
        f"--skip={args.skip}",
        f"--size={args.size}",
        f"--seed={args.seed}",
        *(f"--{k}={v}" for k, v in HYPER.items()),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load = os.getloadavg()[0]  # other work on the machine shows up here
    with open(workdir / f"{tag}.log", "w", encoding="utf-8") as log:
        env[T0_ENV] = repr(time.time())  # as late as possible: startup counts from here
        proc = subprocess.run(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, check=False
        )
    if proc.returncode != 0 or not result.exists():
        tail = (workdir / f"{tag}.log").read_text(encoding="utf-8")[-4000:]
        sys.exit(f"{tag} failed (exit {proc.returncode}); end of its output:\n{tail}")
    record: dict[str, Any] = json.loads(result.read_text(encoding="utf-8"))
    record["load_before"] = load
    return record


def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("nan")


def summarize(pairs: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per-pair medians and ratios, then the medians of those over the pairs."""
    rows = []
    for runs in pairs:
        row: dict[str, Any] = {}
        for key, field in (("step_s", "step_times_s"), ("cpu_s", "cpu_times_s")):
            row[key] = {v: statistics.median(runs[v][field]) for v in VARIANTS}
        row["startup_s"] = {v: runs[v]["startup_s"] for v in VARIANTS}
        for key in ("step", "cpu", "startup"):
            row[f"{key}_ratio"] = ratio(row[f"{key}_s"]["meshrun"], row[f"{key}_s"]["plain"])
        row["startup_diff"] = row["startup_s"]["meshrun"] - row["startup_s"]["plain"]
        for key in ("final_loss", "marks_s", "load_before"):
            row[key] = {v: runs[v][key] for v in VARIANTS}
        rows.append(row)
    out: dict[str, Any] = {}
    for key in ("step", "cpu", "startup"):
        out[f"{key}_s"] = {v: statistics.median(r[f"{key}_s"][v] for r in rows) for v in VARIANTS}
        out[f"{key}_ratio"] = statistics.median(r[f"{key}_ratio"] for r in rows)
    out["startup_diff"] = statistics.median(r["startup_diff"] for r in rows)
    return out | {"final_loss": rows[-1]["final_loss"], "pairs": rows}


def report(s: dict[str, Any], args: argparse.Namespace) -> None:
    timed = args.steps - args.skip
    print(
        f"meshrun overhead | model {args.size} | {args.steps} steps ({timed} timed, "
        f"{args.skip} warm-up) | {args.nproc} processes, gloo, OMP_NUM_THREADS=1 | "
        f"{args.repeats} pairs, plain then meshrun"
    )
    print(
        "pair | s/step plain meshrun ratio | cpu s/step plain meshrun ratio"
        " | startup s plain meshrun ratio | load avg"
    )
    for i, r in enumerate(s["pairs"], 1):
        cols = [f"{i:>4}"]
        for key in ("step", "cpu", "startup"):
            a, b = r[f"{key}_s"]["plain"], r[f"{key}_s"]["meshrun"]
            cols.append(f"{a:.4f} {b:.4f} {r[f'{key}_ratio']:.3f}")
        cols.append(" ".join(f"{r['load_before'][v]:.1f}" for v in VARIANTS))
        print(" | ".join(cols))
    step, cpu, start = s["step_s"], s["cpu_s"], s["startup_s"]
    verdict = "ok" if s["step_ratio"] <= TARGET_RATIO else "ABOVE TARGET"
    print(f"median step time: plain {step['plain']:.4f} s, meshrun {step['meshrun']:.4f} s")
    print(
        f"per-step ratio meshrun/plain: {s['step_ratio']:.3f} (target <= {TARGET_RATIO}: {verdict})"
    )
    print(
        f"per-step CPU-time ratio meshrun/plain: {s['cpu_ratio']:.3f} "
        f"(plain {cpu['plain']:.4f} s, meshrun {cpu['meshrun']:.4f} s)"
    )
    ok = "ok" if s["startup_diff"] <= TARGET_STARTUP_DIFF_S else "ABOVE TARGET"
    print(
        f"(b) startup ratio meshrun/plain (launch to end of first step): "
        f"{s['startup_ratio']:.3f} (plain {start['plain']:.2f} s, meshrun {start['meshrun']:.2f} s"
        f"; median pair difference {s['startup_diff']:+.2f} s, target <= "
        f"+{TARGET_STARTUP_DIFF_S} s: {ok})"
    )
    loss = s["final_loss"]
    print(
        f"final loss at step {args.steps}: plain {loss['plain']:.4f}, "
        f"meshrun {loss['meshrun']:.4f} (difference {abs(loss['plain'] - loss['meshrun']):.1e})"
    )
    for v in VARIANTS:  # where startup goes, last pair: seconds since launch
        marks = s["pairs"][-1]["marks_s"][v]
        print(f"startup marks {v:>7}: " + ", ".join(f"{k} {t:.2f}" for k, t in marks.items()))


def main() -> None:
    args = parse_args()
    print(f"/proc/loadavg before: {Path('/proc/loadavg').read_text().strip()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="meshrun-overhead-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        pairs = []
        for pair in range(1, args.repeats + 1):
            pairs.append({v: launch(v, args, workdir, pair) for v in VARIANTS})  # A then B
            print(f"pair {pair}/{args.repeats} done", file=sys.stderr, flush=True)
    summary = summarize(pairs)
    report(summary, args)
    launcher = None
    if args.launch_pairs > 0:
        launcher = summarize_launch(launch_pairs(args.launch_pairs, args.nproc, args.timeout))
        report_launch(launcher, args.nproc)
    print(f"/proc/loadavg after: {Path('/proc/loadavg').read_text().strip()}")
    if args.out is not None:
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "hyper": HYPER}
        payload |= {"summary": summary, "runs": pairs, "launcher": launcher}
        args.out.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
