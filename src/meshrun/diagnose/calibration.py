"""The calibration file's arithmetic (pure: no torch, no process group): nccl-tests bandwidth
formulas, the alpha-beta fit of the measured collectives, the slow-pair search, the planner's
rates from the measurements (keys of plan.cost.Cluster) and the lines ``meshrun bench`` prints.
The measurements come from diagnose/bench_comm.py and diagnose/bench_compute.py."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# nccl-tests bus-bandwidth factors: busbw = algbw x factor(n).
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}


def bus_bandwidth(op: str, nbytes: float, seconds: float, n: int) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in bytes/s of one collective on ``n`` ranks."""
    alg = nbytes / seconds
    return alg, alg * BUS_FACTOR[op](n)


# Ring steps per call (alpha-beta model): all-reduce 2(n-1), all-gather/reduce-scatter n-1.
RING_STEPS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2.0 * (n - 1),
    "all_gather": lambda n: n - 1.0,
    "reduce_scatter": lambda n: n - 1.0,
}


def fit_collectives(rows: Sequence[dict[str, Any]], n: int) -> dict[str, float]:
    """Fit the alpha-beta model t = steps(n) * alpha + busbw_factor(n) * S / busbw_op to the
    measured all-reduce, all-gather and reduce-scatter rows: one latency per ring step
    (``latency``) and one bus bandwidth per op (``all_reduce``, ...), by least squares on the
    relative error (so 4 KiB and 16 MiB weigh alike). A negative latency (noise) is refitted
    as 0."""
    import numpy as np

    ops = [op for op in RING_STEPS if any(r["op"] == op for r in rows)]
    used = [r for r in rows if r["op"] in ops and r["time_s"] > 0]
    if "all_reduce" not in ops:
        raise ValueError("fit_collectives: no all_reduce rows to fit")
    a = np.zeros((len(used), 1 + len(ops)))
    y = np.ones(len(used))  # t / t: every row weighted by its own time
    for i, r in enumerate(used):
        a[i, 0] = RING_STEPS[r["op"]](n) / r["time_s"]
        a[i, 1 + ops.index(r["op"])] = r["bytes"] * BUS_FACTOR[r["op"]](n) / r["time_s"]
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    if coef[0] < 0:
        coef = np.concatenate([[0.0], np.linalg.lstsq(a[:, 1:], y, rcond=None)[0]])
    out = {"latency": float(coef[0])}
    for i, op in enumerate(ops):
        inv = float(coef[1 + i])
        # No bandwidth signal (noise swamped it): the op's best measured bus bandwidth.
        best = max(r["busbw"] for r in used if r["op"] == op)
        out[op] = 1.0 / inv if inv > 0 else best
    return out


def sustained_bw(rows: Sequence[dict[str, Any]], n: int, op: str = "all_reduce") -> float:
    """``op``'s bus bandwidth from its largest message and one 16x smaller (two sweep sizes
    down): the extra bytes over the extra time, what the link sustains once a message is past
    any burst. A shaped link (tc tbf, a cloud NIC's rate limit) passes the sweep's small
    messages at line rate from its bucket, so they do not lie on the large ones' alpha-beta
    line and a fit over all sizes overstates the rate (measured over 100 Mb/s tbf: 107-114
    Mb/s fitted). The 16x lever keeps a stall in the smaller message's few calls from moving
    the slope much (between neighbours, 4x apart, one run read 123 Mb/s). One size only, or
    no growth: the largest message's bus bandwidth."""
    mine = sorted((r for r in rows if r["op"] == op and r["time_s"] > 0), key=lambda r: r["bytes"])
    if not mine:
        raise ValueError(f"sustained_bw: no {op} rows")
    big = mine[-1]
    lever = [r for r in mine if r["bytes"] * 16 <= big["bytes"]] or mine[:1]
    small = lever[-1]
    extra_t, extra_b = big["time_s"] - small["time_s"], big["bytes"] - small["bytes"]
    if extra_t <= 0 or extra_b <= 0:
        return float(big["busbw"])
    return extra_b * BUS_FACTOR[op](n) / extra_t


def message_sizes(max_bytes: int, min_bytes: int = 4096) -> list[int]:
    """Powers of 4 from ``min_bytes`` up to ``max_bytes`` (inclusive of the last power)."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= 4
    return sizes


def slow_pairs(bw: Sequence[Sequence[float]], factor: float = 0.5) -> list[tuple[int, int]]:
    """The pairs whose bandwidth is below ``factor`` x the median of all pairs."""
    values = [bw[i][j] for i in range(len(bw)) for j in range(i + 1, len(bw))]
    if not values:
        return []
    median = statistics.median(values)
    return [
        (i, j) for i in range(len(bw)) for j in range(i + 1, len(bw)) if bw[i][j] < factor * median
    ]


def pairs_report(pairs: dict[str, Any]) -> list[str]:
    """The matrix in GB/s, then each slow link named (or a line saying there is none)."""
    labels, bw = pairs["labels"], pairs["bw"]
    width = max(8, *(len(x) for x in labels)) + 1
    lines = [
        f"send/recv bandwidth between pairs, {pairs['bytes'] / 2**20:g} MiB each way, GB/s:",
        " " * width + "".join(f"{x:>{width}}" for x in labels),
    ]
    for i, row in enumerate(bw):
        cells = "".join(
            f"{'-':>{width}}" if i == j else f"{v / 1e9:>{width}.3f}" for j, v in enumerate(row)
        )
        lines.append(f"{labels[i]:>{width}}{cells}")
    values = [bw[i][j] for i in range(len(bw)) for j in range(i + 1, len(bw))]
    slow = slow_pairs(bw)
    for i, j in slow:
        lines.append(
            f"slow link: {labels[i]} <-> {labels[j]} at {bw[i][j] / 1e9:.3f} GB/s, "
            f"{bw[i][j] / statistics.median(values):.2f}x the median of all pairs"
        )
    if values and not slow:
        lines.append(
            f"no slow link: every pair within 2x of the median "
            f"{statistics.median(values) / 1e9:.3f} GB/s"
        )
    return lines


def calibration(results: dict[str, Any], world: int, device: Any) -> dict[str, Any]:
    """The planner's rates from the measurements (keys of plan.cost.Cluster)."""
    cluster: dict[str, float] = {}
    if "compute" in results:
        c = results["compute"]
        cluster["peak_flops"] = c["matmul_flops"]
        cluster["compute_efficiency"] = min(1.0, c["model_flops"] / c["matmul_flops"])
        for key in ("mem_bw", "optimizer_bw"):
            if key in c:
                cluster[key] = c[key]
    cluster.update(_comm_rates(results, world, device))
    if "tp" in results and device.type == "cpu":
        # On a CPU DTensor's dispatch takes the cores the math needs; a GPU's host runs ahead
        # of its kernels, so there it stays in `measured` only (the planner's default is 0).
        cluster["tp_layer_overhead"] = results["tp"]["tp_layer_overhead"]
    if "fsdp" in results and device.type == "cpu":
        # The same on a CPU for FSDP2's per-unit hooks and blocking collectives; a GPU's
        # streams and host running ahead hide them (the planner's default, 0, stays).
        cluster["fsdp_unit_overhead"] = results["fsdp"]["fsdp_unit_overhead"]
    cluster["memory_bytes"] = _device_memory(device, world)
    return cluster


def _comm_rates(results: dict[str, Any], world: int, device: Any) -> dict[str, float]:
    """The link rates: one node's collectives (``comm``), then a run across nodes
    (``comm_inter``), whose all-reduce ring crosses the nodes' link, the slowest of its hops:
    its sustained rate is the inter-node one, and one node's run, if any, keeps ``intra_*``."""
    rates: dict[str, float] = {}
    if "comm" in results:
        fit = fit_collectives(results["comm"], world)
        # One node measured: the fitted all-reduce bus bandwidth and latency stand for both
        # links; all-gather and reduce-scatter keep their own rates as ratios to it.
        rates["intra_bw"] = rates["inter_bw"] = fit["all_reduce"]
        rates["intra_latency"] = rates["inter_latency"] = fit["latency"]
        for op in ("all_gather", "reduce_scatter"):
            if op in fit:
                rates[f"{op}_ratio"] = fit[op] / fit["all_reduce"]
    if "comm_inter" in results:
        inter = results["comm_inter"]
        fit = fit_collectives(inter["rows"], inter["world"])
        rates["inter_bw"] = sustained_bw(inter["rows"], inter["world"])
        rates["inter_latency"] = fit["latency"]
    if rates:
        rates["comm_efficiency"] = 1.0
        if device.type == "cpu":
            # Gloo runs collectives on the same cores as the math: nothing hides.
            rates["overlap"] = 0.0
    return rates


def _device_memory(device: Any, world: int) -> float:
    import torch

    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) / world


def write_calibration(
    path: str, results: dict[str, Any], world: int, device: Any, nodes: int = 1
) -> None:
    """Merge ``results`` into the calibration file at ``path`` (written atomically)."""
    p = Path(path)
    doc: dict[str, Any] = json.loads(p.read_text()) if p.is_file() else {}
    measured = {**doc.get("measured", {}), **results}
    where = f" on {nodes} nodes" if nodes > 1 else ""
    doc = {
        "source": f"meshrun bench on {world} {device.type} processes{where}",
        "cluster": {**doc.get("cluster", {}), **calibration(measured, world, device)},
        "measured": measured,
    }
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(p)


# What each compute figure is, and its unit: FLOP/s for arithmetic, bytes/s for memory traffic.
_COMPUTE_FIGURES = {
    "matmul_flops": ("matmul (peak)", "GFLOP/s"),
    "model_flops": ("demo GPT training", "GFLOP/s"),
    "mem_bw": ("memory copy (64 MiB)", "GB/s"),
    "optimizer_bw": ("AdamW step (28 B/param)", "GB/s"),
}


def compute_lines(compute: dict[str, float]) -> list[str]:
    """``bench_compute``'s figures (slowest rank) as aligned lines, each with its unit."""
    rows = [(*_COMPUTE_FIGURES.get(key, (key, "G/s")), value) for key, value in compute.items()]
    width = max((len(label) for label, _, _ in rows), default=0)
    return ["compute, slowest rank:"] + [
        f"  {label:<{width}}  {value / 1e9:>9.2f} {unit}" for label, unit, value in rows
    ]


def comm_lines(rows: list[dict[str, Any]]) -> list[str]:
    """``bench_comm``'s rows as a table: time and both bandwidths per op and size."""
    lines = [f"{'op':>15} {'bytes':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in rows:
        lines.append(
            f"{r['op']:>15} {r['bytes']:>10} {r['time_s'] * 1e6:>10.1f} "
            f"{r['algbw'] / 1e9:>11.3f} {r['busbw'] / 1e9:>11.3f}"
        )
    return lines


def inter_record(rows: list[dict[str, Any]], world: int, nodes: int) -> dict[str, Any]:
    """A run across nodes, as the calibration file keeps it (``measured.comm_inter``): with
    its world, since one node's run, merged into the same file, has another."""
    return {"rows": rows, "world": world, "nodes": nodes}


def inter_lines(inter: dict[str, Any]) -> list[str]:
    """The link between the nodes: the all-reduce's sustained bus bandwidth in the units a
    network is sold in (bits/s), the largest message's, and the fitted latency."""
    rows, world, nodes = inter["rows"], inter["world"], inter["nodes"]
    bw, latency = sustained_bw(rows, world), fit_collectives(rows, world)["latency"]
    largest = max((r for r in rows if r["op"] == "all_reduce"), key=lambda r: r["bytes"])
    return [
        f"inter-node link ({nodes} nodes, {world} processes): all_reduce bus bandwidth "
        f"{bw * 8 / 1e6:.1f} Mb/s ({bw / 1e9:.4f} GB/s) sustained up to the largest "
        f"message ({largest['busbw'] * 8 / 1e6:.1f} Mb/s at {largest['bytes'] / 2**20:g} "
        f"MiB), latency {latency * 1e6:.0f} us per ring step (fitted over the sizes)"
    ]


def results_lines(results: dict[str, Any]) -> list[str]:
    """What rank 0 prints of the measurements, in the order they are taken."""
    lines = comm_lines(results["comm"]) if "comm" in results else []
    if "comm_inter" in results:
        lines += comm_lines(results["comm_inter"]["rows"])
        lines += inter_lines(results["comm_inter"])
    if "pairs" in results:
        lines += pairs_report(results["pairs"])
    if "tp" in results:
        lines.append(
            f"tensor parallel: {results['tp']['tp_layer_overhead'] * 1e3:.3f} ms of "
            "DTensor dispatch per linear layer (forward + backward)"
        )
    if "fsdp" in results:
        lines.append(
            f"FSDP2: {results['fsdp']['fsdp_unit_overhead'] * 1e3:.3f} ms per unit "
            "collective beyond its bytes (hooks, waiting for the slower rank)"
        )
    if "compute" in results:
        lines += compute_lines(results["compute"])
    return lines
