"""What ``meshrun launch`` costs over ``torchrun`` on a plain script, in interleaved pairs.

Both launchers start the same torch-only script (``overhead_launch_plain.py``: process group,
one all-reduce, exit) in N processes, as a user types them: the ``torchrun`` and ``meshrun``
programs of this interpreter's environment (``python -m ...`` where they are missing), with
``OMP_NUM_THREADS=1``, ``torchrun --standalone`` against ``meshrun launch`` (which takes a
free loopback port itself). The order alternates, torchrun first in odd pairs, so that a
machine getting busier hits both alike. Per run: wall seconds from the start of the launcher
to its exit, and the CPU seconds of the launcher and everything it started (from
``RUSAGE_CHILDREN``), which other processes' load disturbs less than wall time.

Printed: each pair with the load average, then the medians, the median of the per-pair
ratios meshrun/torchrun and the median of the per-pair differences (target: +0.15 s wall).

    .venv/bin/python benchmarks/overhead_launch.py [--pairs 6] [--nproc 2]
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
LAUNCHERS = ("torchrun", "meshrun")
TARGET_DIFF_S = 0.15


def program(name: str) -> list[str]:
    """The console script next to this interpreter, else ``python -m`` of its module."""
    found = Path(sys.executable).with_name(name)
    if found.is_file():
        return [str(found)]
    return [sys.executable, "-m", "torch.distributed.run" if name == "torchrun" else "meshrun"]


def command(launcher: str, nproc: int, run_dir: Path) -> list[str]:
    script = str(HERE / "overhead_launch_plain.py")
    if launcher == "torchrun":
        return [*program("torchrun"), "--standalone", "--nproc-per-node", str(nproc), script]
    return [
        *program("meshrun"),
        *("launch", "--nproc-per-node", str(nproc), "--set", f"job.run_dir={run_dir}", script),
    ]


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def one_run(launcher: str, nproc: int, workdir: Path, tag: str, timeout: float) -> dict[str, Any]:
    """Wall and CPU (launcher + workers) seconds of one launch; exits on a failed run."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load = load_average()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        command(launcher, nproc, workdir / tag),
        env=env,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).decode(errors="replace")[-3000:]
        sys.exit(f"{launcher} ({tag}) failed with exit {proc.returncode}:\n{tail}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "load_before": load}


def launch_pairs(pairs: int, nproc: int = 2, timeout: float = 300) -> list[dict[str, Any]]:
    """``pairs`` interleaved pairs; odd pairs start with torchrun, even ones with meshrun."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshrun-launch-overhead-") as tmp:
        for i in range(pairs):
            order = LAUNCHERS if i % 2 == 0 else LAUNCHERS[::-1]
            row = {v: one_run(v, nproc, Path(tmp), f"{v}_{i}", timeout) for v in order}
            rows.append(row)
            print(f"launch pair {i + 1}/{pairs} done", file=sys.stderr, flush=True)
            shutil.rmtree(Path(tmp) / f"meshrun_{i}", ignore_errors=True)
    return rows


def summarize_launch(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"pairs": rows}
    for key in ("wall_s", "cpu_s"):
        t = [r["torchrun"][key] for r in rows]
        m = [r["meshrun"][key] for r in rows]
        out[key] = {
            "torchrun": statistics.median(t),
            "meshrun": statistics.median(m),
            "ratio": statistics.median(b / a for a, b in zip(t, m, strict=True)),
            "diff": statistics.median(b - a for a, b in zip(t, m, strict=True)),
        }
    return out


def report_launch(s: dict[str, Any], nproc: int) -> None:
    print(
        f"launcher overhead | plain script (process group, one all-reduce) | {nproc} processes,"
        f" OMP_NUM_THREADS=1 | {len(s['pairs'])} pairs, alternating order"
    )
    print("pair | wall s torchrun meshrun diff | cpu s torchrun meshrun diff | load avg t m")
    for i, r in enumerate(s["pairs"], 1):
        t, m = r["torchrun"], r["meshrun"]
        print(
            f"{i:>4} | {t['wall_s']:.3f} {m['wall_s']:.3f} {m['wall_s'] - t['wall_s']:+.3f}"
            f" | {t['cpu_s']:.3f} {m['cpu_s']:.3f} {m['cpu_s'] - t['cpu_s']:+.3f}"
            f" | {t['load_before']:.1f} {m['load_before']:.1f}"
        )
    w, c = s["wall_s"], s["cpu_s"]
    verdict = "ok" if w["diff"] <= TARGET_DIFF_S else "ABOVE TARGET"
    print(
        f"(a) meshrun launch vs torchrun, wall: {w['meshrun']:.3f} s vs {w['torchrun']:.3f} s"
        f" (medians); median pair ratio {w['ratio']:.3f}, median pair difference"
        f" {w['diff']:+.3f} s (target <= +{TARGET_DIFF_S} s: {verdict})"
    )
    print(
        f"(a) meshrun launch vs torchrun, CPU of launcher + workers: {c['meshrun']:.3f} s vs"
        f" {c['torchrun']:.3f} s; median pair ratio {c['ratio']:.3f}, difference"
        f" {c['diff']:+.3f} s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=6, help="interleaved pairs (default 6)")
    p.add_argument("--nproc", type=int, default=2, help="processes per launch (default 2)")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per launch")
    args = p.parse_args()
    print(f"/proc/loadavg before: {Path('/proc/loadavg').read_text().strip()}")
    report_launch(summarize_launch(launch_pairs(args.pairs, args.nproc, args.timeout)), args.nproc)
    print(f"/proc/loadavg after: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
