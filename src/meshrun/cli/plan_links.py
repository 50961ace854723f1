"""``meshrun plan --diloco H,...``: the slow-link comparison (plan/links.py) on the plan's
model and cluster: DDP, HSDP, ZeRO-3 and DiLoCo rows, and which to use (docs/slow_links.md)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from meshrun.plan.cost import Cluster, Estimate, Layout, Model, Training
from meshrun.plan.errors import PlanError
from meshrun.plan.links import (
    DEFAULT_THRESHOLD,
    OUTER_BYTES,
    LinkRow,
    link_rows,
    recommend,
    table_lines,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("slow links between nodes (docs/slow_links.md)")
    g.add_argument(
        "--diloco",
        metavar="H,...",
        help="also compare DDP, HSDP, ZeRO-3 and DiLoCo with these inner steps per outer "
        "step (e.g. 10,50,100) across the nodes, and say which to use",
    )
    g.add_argument(
        "--inter-node-gbps",
        type=float,
        help="the link between nodes in Gb/s per node, shared by its GPUs (sets --inter-bw "
        "to it / 8 / gpus-per-node GB/s)",
    )
    g.add_argument(
        "--efficiency-threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help="with --diloco: recommend DiLoCo when the best synchronous layout's scaling "
        f"efficiency is below this ({DEFAULT_THRESHOLD})",
    )
    g.add_argument(
        "--outer-precision",
        choices=list(OUTER_BYTES),
        default="fp32",
        help="with --diloco: the outer all-reduce's bytes per parameter: fp32 (torchft's "
        "default), bf16, quantized (1 byte)",
    )


def apply_link_flags(a: argparse.Namespace, c: Cluster) -> Cluster:
    """``--inter-node-gbps``: a node's link, in the unit links are sold in, per GPU."""
    gbps = getattr(a, "inter_node_gbps", None)
    if gbps is None:
        return c
    if gbps <= 0:
        raise PlanError(f"--inter-node-gbps {gbps:g} is not allowed: must be > 0")
    return dataclasses.replace(c, inter_bw=gbps * 1e9 / 8 / c.gpus_per_node)


def sync_every(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(f"--diloco {text!r}: expected integers H separated by commas") from None
    if not values:
        raise PlanError(f"--diloco {text!r}: expected at least one H")
    return values


def links_report(
    a: argparse.Namespace, m: Model, t: Training, c: Cluster, best: Sequence[Estimate] = ()
) -> tuple[list[str], dict[str, Any]] | None:
    """The table and the advice as lines, and the same as JSON; None without ``--diloco``.
    ``best``: the plan's best layouts, compared as synchronous rows too."""
    if not getattr(a, "diloco", None):
        return None
    searched = [(f"plan #{i}: {_short(e.layout)}", e.layout) for i, e in enumerate(best, 1)]
    rows = link_rows(m, t, c, sync_every(a.diloco), a.outer_precision, searched)
    advice = recommend(rows, a.efficiency_threshold)
    title = (
        f"across {c.nodes} nodes at {c.inter_bw * c.gpus_per_node * 8 / 1e9:.3g} Gb/s per "
        f"node ({c.inter_bw / 1e9:.3g} GB/s per GPU), global batch {t.global_batch}:"
    )
    lines = [title, *table_lines(rows), *advice.lines]
    doc = {
        "rows": [_row_json(r) for r in rows],
        "recommended": advice.choice.name,
        "threshold": a.efficiency_threshold,
        "advice": advice.lines,
    }
    return lines, doc


def _short(lay: Layout) -> str:
    """The layout's keys that differ from one GPU's (``dp_shard=4 pp=8 zero=3``)."""
    keys = ("dp_replicate", "dp_shard", "tp", "pp", "zero")
    return " ".join(f"{k}={getattr(lay, k)}" for k in keys if getattr(lay, k) not in (0, 1))


def _row_json(r: LinkRow) -> dict[str, Any]:
    return {
        "name": r.name,
        "sync_every": r.sync_every,
        "step_time_s": r.step_s,
        "comm_s": r.comm_s,
        "comm_share": r.comm_share,
        "scaling_efficiency": r.efficiency,
        "bytes_per_gpu_per_step": r.link_bytes,
    }
