"""The worker of ``meshrun bench`` (``python -m meshrun.diagnose.bench_worker``, started on
every rank by diagnose/cli.py through ``launch_local``): runs the measurements the parent asked
for, prints them on rank 0 and merges them into the calibration file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from meshrun.diagnose.bench_comm import bench_comm, bench_pairs
from meshrun.diagnose.bench_compute import bench_compute, bench_fsdp, bench_tp, slowest_rank_rates
from meshrun.diagnose.calibration import results_lines, write_calibration

MODULE = "meshrun.diagnose.bench_worker"


def worker(argv: Sequence[str] | None = None) -> None:
    import meshrun

    p = argparse.ArgumentParser(prog=MODULE)
    p.add_argument("--kind", default="all")
    p.add_argument("--out", required=True)
    p.add_argument("--max-mb", type=float, default=16.0)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--seconds", type=float, default=0.3)
    p.add_argument("--pairs", action="store_true")
    p.add_argument("--pair-mb", type=float, default=4.0)
    a = p.parse_args(argv)
    run = meshrun.init(argv=[])
    results = measure(a, run.device)
    if run.is_main:
        if lines := results_lines(results):
            print("\n".join(lines))
        write_calibration(a.out, results, run.world_size, run.device)


def measure(a: argparse.Namespace, device: Any) -> dict[str, Any]:
    """Every measurement ``a.kind`` asks for, as the calibration file's ``measured`` parts."""
    results: dict[str, Any] = {}
    if a.kind in ("compute", "all"):
        results["compute"] = slowest_rank_rates(
            bench_compute(device, a.precision, a.seconds), device
        )
    if a.kind in ("comm", "all"):
        results["comm"] = bench_comm(device, int(a.max_mb * 2**20), a.seconds)
        results["tp"] = bench_tp(device, a.seconds)
        results["fsdp"] = bench_fsdp(device, a.seconds)
        if a.pairs:
            results["pairs"] = bench_pairs(device, int(a.pair_mb * 2**20), a.seconds)
    return results


if __name__ == "__main__":
    from meshrun.entry import main as _entry

    _entry(worker)(sys.argv[1:])
