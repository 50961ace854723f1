"""Time to the first optimizer step: ``mpirun -np N`` against ``meshrun launch --nproc-per-node
N``, the tiny demo on one host, interleaved (the order alternates every round), medians.

    .venv/bin/python benchmarks/mpirun_first_step.py [--rounds 5] [--nproc 2]

The clock starts when the launcher is started and stops when ``metrics.jsonl`` holds the first
step's row (written by rank 0 after step 1); the run then finishes its 2 steps. Under mpirun
meshrun asks MPI for rank 0's endpoint (mpi4py); under meshrun launch torchrun's agent makes
a c10d rendezvous. Both pay the same imports and the same demo start (corpus, model, layout).
Open MPI's root switches are set, so it runs as root in containers.
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

DEMO = ["-m", "meshrun.demo", "--steps", "2", "--size", "tiny", "--corpus-bytes", "300000"]
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def first_step_s(argv: list[str], run_dir: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(ROOT_OK, OMP_NUM_THREADS="1")
    metrics = run_dir / "metrics.jsonl"
    start = time.monotonic()
    proc = subprocess.Popen(
        [*argv, "--run-dir", str(run_dir)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    took = None
    while proc.poll() is None or took is None:
        if took is None and metrics.exists() and _has_step(metrics):
            took = time.monotonic() - start
        if proc.poll() is not None and took is None:
            raise RuntimeError(f"{argv[0]} exited {proc.returncode} before a step")
        time.sleep(0.05)
    if proc.wait() != 0:
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}")
    return took


def _has_step(metrics: Path) -> bool:
    for line in metrics.read_text().splitlines():
        try:
            if "event" not in json.loads(line):
                return True
        except json.JSONDecodeError:  # a row still being written
            return False
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    n = str(args.nproc)
    launchers = {
        "mpirun": ["mpirun", "-np", n, sys.executable, *DEMO],
        "meshrun launch": [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", n, *DEMO],
    }
    times: dict[str, list[float]] = {name: [] for name in launchers}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = list(launchers) if i % 2 == 0 else list(reversed(launchers))
            for name in order:
                took = first_step_s(launchers[name], Path(tmp) / f"{name[:3]}{i}")
                times[name].append(took)
                load = Path("/proc/loadavg").read_text().split()[:3]  # others' jobs share the CPUs
                print(f"round {i + 1} {name}: {took:.2f} s (loadavg {' '.join(load)})", flush=True)
    for name, values in times.items():
        print(
            f"{name}: median {statistics.median(values):.2f} s over {len(values)} runs "
            f"(min {min(values):.2f}, max {max(values):.2f})"
        )


if __name__ == "__main__":
    main()
