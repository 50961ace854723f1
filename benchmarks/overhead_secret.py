"""What the job secret costs at start: launch to the end of the first step, with the signed
rendezvous and bound stores against the same meshrun without them, in interleaved pairs.

The two variants: this checkout's ``src`` as it is, and a copy of it with the job secret's
commits applied in reverse (``--revert``); each runs with its own ``src`` first on
``PYTHONPATH`` and the same script (``overhead_secret_step.py``: init, one
step, rank 0 writes the time the step ended). Per run: the seconds from starting ``python -m
meshrun launch --nproc-per-node N`` to the end of the first step. The order alternates each
pair so that a machine getting busier hits both alike. Printed: each pair with the load
average, the medians, and the median of the per-pair differences (target: within 0.05 s).

    .venv/bin/python benchmarks/overhead_secret.py [--pairs 8] [--nproc 2] [--revert REV...]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = HERE / "overhead_secret_step.py"
TARGET_DIFF_S = 0.05
# The commits that brought the job secret, newest first (what the variant without reverts).
SECRET_COMMITS = ("b4f79f4", "89ab30b", "cf6f12b", "da92eef", "7b1302d")


def without_secret(where: Path, commits: tuple[str, ...]) -> Path:
    """A copy of this checkout's ``src`` with ``commits`` (newest first) applied in reverse."""
    shutil.copytree(ROOT / "src", where / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for rev in commits:
        patch = subprocess.run(
            ["git", "-C", str(ROOT), "show", "--format=", rev, "--", "src"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(
            ["git", "apply", "-R", "-C1", "-"],
            cwd=where,
            input=patch,
            check=True,
            capture_output=True,
        )
    return where / "src"


def one_run(src: Path, nproc: int, tmp: Path, tag: str, timeout: float) -> dict[str, float]:
    first = tmp / f"{tag}.first"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_JOB_SECRET")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(src), FIRST_STEP=str(first))
    load = float(Path("/proc/loadavg").read_text().split()[0])
    argv = [
        sys.executable,
        "-m",
        "meshrun",
        "launch",
        "--nproc-per-node",
        str(nproc),
        str(SCRIPT),
        f"--job.run_dir={tmp / tag}",
        "--optim.steps=1",
        "--data.global_batch=16",
        "--data.micro_batch=8",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    proc = subprocess.run(argv, env=env, capture_output=True, timeout=timeout, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0 or not first.exists():
        sys.exit(f"{tag} failed ({proc.returncode}):\n{proc.stderr.decode()[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"first_step_s": float(first.read_text()) - start, "cpu_s": cpu, "load": load}


def pairs(srcs: dict[str, Path], n: int, nproc: int, timeout: float) -> list[dict[str, Any]]:
    names = list(srcs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshrun-secret-overhead-") as tmp:
        for i in range(n):
            order = names if i % 2 == 0 else names[::-1]
            rows.append({v: one_run(srcs[v], nproc, Path(tmp), f"{v}_{i}", timeout) for v in order})
            print(f"pair {i + 1}/{n} done", file=sys.stderr, flush=True)
    return rows


def report(rows: list[dict[str, Any]], nproc: int, revs: dict[str, str]) -> None:
    print(
        f"launch to the end of the first step | {nproc} processes, OMP_NUM_THREADS=1 | "
        f"{len(rows)} pairs, alternating | with = {revs['with']}, without = {revs['without']}"
    )
    print(
        "pair | to first step: without s | with s | diff s | CPU s (whole run): without | with"
        " | load avg"
    )
    for i, r in enumerate(rows, 1):
        a, b = r["without"]["first_step_s"], r["with"]["first_step_s"]
        ca, cb = r["without"]["cpu_s"], r["with"]["cpu_s"]
        print(
            f"{i:>4} | {a:.3f} | {b:.3f} | {b - a:+.3f} | {ca:.2f} | {cb:.2f} |"
            f" {r['without']['load']:.1f}"
        )
    cpu_diff = statistics.median(r["with"]["cpu_s"] - r["without"]["cpu_s"] for r in rows)
    print(f"CPU seconds of launcher + workers: median pair difference {cpu_diff:+.3f} s")
    a = statistics.median(r["without"]["first_step_s"] for r in rows)
    b = statistics.median(r["with"]["first_step_s"] for r in rows)
    diff = statistics.median(r["with"]["first_step_s"] - r["without"]["first_step_s"] for r in rows)
    verdict = "ok" if diff <= TARGET_DIFF_S else "ABOVE TARGET"
    print(
        f"medians: without {a:.3f} s, with {b:.3f} s; median pair difference {diff:+.3f} s "
        f"(target <= +{TARGET_DIFF_S} s: {verdict})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--revert", nargs="+", default=list(SECRET_COMMITS))
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    revs = {"with": "this checkout", "without": f"the same less {' '.join(args.revert)}"}
    with tempfile.TemporaryDirectory(prefix="meshrun-secret-src-") as tmp:
        srcs = {"with": ROOT / "src", "without": without_secret(Path(tmp), tuple(args.revert))}
        rows = pairs(srcs, args.pairs, args.nproc, args.timeout)
    report(rows, args.nproc, revs)


if __name__ == "__main__":
    main()
