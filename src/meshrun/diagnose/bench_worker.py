"""The worker of ``meshrun bench`` (``python -m meshrun.diagnose.bench_worker REQUEST``, started
on every rank by cli/diagnose.py through ``launch_local``): runs the measurements the parent asked
for, prints them on rank 0 and merges them into the calibration file.

The parent's request travels as one JSON argument (diagnose/bench_request.py), not as flags.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from meshrun.diagnose.bench_comm import bench_comm, bench_pairs
from meshrun.diagnose.bench_compute import bench_compute, bench_fsdp, bench_tp, slowest_rank_rates
from meshrun.diagnose.bench_request import BenchRequest
from meshrun.diagnose.calibration import inter_record, results_lines, write_calibration

MODULE = "meshrun.diagnose.bench_worker"


def worker(argv: Sequence[str] | None = None) -> None:
    import meshrun

    a = BenchRequest.from_argv(sys.argv[1:] if argv is None else argv)
    run = meshrun.init(argv=[])
    results = measure(a, run.device, run.world_size)
    if run.is_main:
        if lines := results_lines(results):
            print("\n".join(lines))
        write_calibration(a.out, results, run.world_size, run.device, a.nodes)


def measure(a: BenchRequest, device: Any, world: int = 1) -> dict[str, Any]:
    """Every measurement ``a.kind`` asks for, as the calibration file's ``measured`` parts."""
    results: dict[str, Any] = {}
    if a.kind in ("compute", "all"):
        results["compute"] = slowest_rank_rates(
            bench_compute(device, a.precision, a.seconds), device
        )
    if a.kind not in ("comm", "all"):
        return results
    rows = bench_comm(device, int(a.max_mb * 2**20), a.seconds)
    if a.nodes > 1:
        # Across nodes the collectives measure the link between them: kept apart from one
        # node's "comm" (the intra-node rates), so that both runs merge into one file. The
        # per-layer overheads are one node's matter and are not retaken here.
        results["comm_inter"] = inter_record(rows, world, a.nodes)
    else:
        results["comm"] = rows
        results["tp"] = bench_tp(device, a.seconds)
        results["fsdp"] = bench_fsdp(device, a.seconds)
    if a.pairs:
        results["pairs"] = bench_pairs(device, int(a.pair_mb * 2**20), a.seconds)
    return results


if __name__ == "__main__":
    from meshrun.train.entry import main as _entry

    _entry(worker)(sys.argv[1:])
