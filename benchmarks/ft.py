"""What a lost worker costs: torchrun restarts + shared checkpoint (a) against replica groups
on torchft (b), the same fault (SIGKILL of one worker at random steps, ``--kills`` times), the
same job (tests/e2e/scripts/ft_worker.py: 2 processes, an MLP, AdamW).

    .venv/bin/python benchmarks/ft.py [--kills 5] [--steps 60] [--pairs 3] [--out ft.json]

(a) ``meshrun launch --nproc-per-node 2 --max-restarts K``, ``checkpoint.interval = 5``: a kill
stops both workers; torchrun starts both again and they resume from the newest checkpoint.
(b) ``meshrun launch --nproc-per-node 2 --replica-groups 2``: group 1's worker is killed; its
agent restarts it and it heals from group 0, which never stops.

Per failure: wall time lost (the faulty run's wall time minus a fault-free run's, divided by
the kills), steps lost (a: steps trained again after the resume; b: the steps the survivor did
not commit), time from the kill to the survivors' next committed step, and to the restarted
worker's first committed step (a: the same processes). A kill's time is the mtime of the
marker the worker writes just before it dies. The job steps ``FT_SLEEP_S`` (0.1 s) per step so
that a restart lands mid-run; (b)'s survivor waits for the restarted group after 3 steps alone
and before the last 3 (the worker's test hooks), so both modes train all their kills.

Overhead without faults: plain DP and replica groups (2 x 1), interleaved ``--pairs`` times, the
median step time of each run (steps 5..end), the ratio (b)/(a) per pair, the median of ratios,
with the load average (``/proc/loadavg``) before and after: on a shared machine the figure is
only as good as the load it was measured under. ``--kills 0`` measures the overhead alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "e2e" / "scripts" / "ft_worker.py"
KEYS = ["--data.micro_batch=8", "--data.global_batch=16"]
FT_KEYS = ["--fault_tolerance.min_replicas=1", "--fault_tolerance.heartbeat_timeout_ms=1000"]


def launch(run_dir: Path, steps: int, mode: str, env: dict[str, str], kills: int) -> float:
    """One run; returns its wall time in seconds."""
    flags = ["--max-restarts", str(kills + 1)]
    keys = [*KEYS, f"--optim.steps={steps}"]
    if mode == "ft":
        flags += ["--replica-groups", "2"]
        keys += FT_KEYS
    else:
        keys += ["--checkpoint.interval=5"]
        env = {**env, "FT_RESUME": "1"}
    cmd = [
        sys.executable,
        "-m",
        "meshrun",
        "launch",
        "--nproc-per-node",
        "2",
        *flags,
        str(WORKER),
        f"--job.run_dir={run_dir}",
        *keys,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    return wall


def rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in rows(run_dir) if "event" not in r]


def kill_times(run_dir: Path) -> list[float]:
    return sorted(p.stat().st_mtime for p in run_dir.glob("done.kill*"))


def first_step_after(run_dir: Path, t: float) -> float:
    return min(r["time"] for r in step_rows(run_dir) if r["time"] > t) - t


def faulty_figures(run_dir: Path, mode: str, wall: float, clean: float, kills: int) -> dict:
    if mode == "ft":
        survivor, healed = run_dir / "group0", run_dir / "group1"
        lost_steps = sum(1 for r in rows(survivor) if r.get("event") == "ft_uncommitted")
        alone = sum(1 for r in step_rows(survivor) if r.get("live_groups") == 1)
    else:
        survivor = healed = run_dir
        lost_steps = len(step_rows(run_dir)) - len({r["step"] for r in step_rows(run_dir)})
        alone = 0
    times = kill_times(healed)
    return {
        "kills": len(times),
        "wall_s": round(wall, 2),
        "wall_lost_per_failure_s": round((wall - clean) / max(1, len(times)), 2),
        "steps_lost_per_failure": round(lost_steps / max(1, len(times)), 2),
        "steps_at_reduced_batch": alone,
        "survivor_next_commit_s": [round(first_step_after(survivor, t), 2) for t in times],
        "restarted_first_commit_s": [round(first_step_after(healed, t), 2) for t in times],
    }


def median_step(run_dir: Path) -> float:
    return statistics.median(r["step_time_s"] for r in step_rows(run_dir) if r["step"] >= 5)


def overhead(tmp: Path, steps: int, pairs: int) -> dict[str, Any]:
    ratios, dp_s, ft_s = [], [], []
    load_before = os.getloadavg()
    for i in range(pairs):
        launch(tmp / f"o{i}dp", steps, "dp", {}, 0)
        launch(tmp / f"o{i}ft", steps, "ft", {}, 0)
        a, b = median_step(tmp / f"o{i}dp"), median_step(tmp / f"o{i}ft" / "group0")
        dp_s.append(a)
        ft_s.append(b)
        ratios.append(b / a)
    return {
        "dp_step_s": [round(x, 4) for x in dp_s],
        "ft_step_s": [round(x, 4) for x in ft_s],
        "ratios": [round(x, 3) for x in ratios],
        "ratio_median": round(statistics.median(ratios), 3),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rng = random.Random()
    kills = sorted(rng.sample(range(4, a.steps - 8), a.kills))
    tmp = Path(tempfile.mkdtemp(prefix="meshrun-ft-bench-"))
    env = {"FT_SLEEP_S": "0.1", "FT_HOLD_AT": str(a.steps - 3)}
    result: dict[str, Any] = {"kill_steps": kills, "steps": a.steps}
    for mode, group in (("dp", 0), ("ft", 1)) if a.kills else ():
        clean = launch(tmp / f"{mode}-clean", a.steps, mode, env, 0)
        fault = {**env, "FT_KILL_STEPS": f"{group}:" + ",".join(map(str, kills))}
        wall = launch(tmp / f"{mode}-fault", a.steps, mode, fault, a.kills)
        result[mode] = {
            "clean_wall_s": round(clean, 2),
            **faulty_figures(tmp / f"{mode}-fault", mode, wall, clean, a.kills),
        }
        print(json.dumps({mode: result[mode]}), flush=True)
    if a.pairs:
        result["overhead"] = overhead(tmp, a.steps, a.pairs)
        print(json.dumps({"overhead": result["overhead"]}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
