"""``meshrun plan --model``'s traced memory: the flags, the traces, their table and JSON."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from meshrun.plan.cost import Cluster, Model, Training
from meshrun.plan.search import Plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("traced memory (with --model)")
    g.add_argument(
        "--trace",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trace the model under each layout shown (fake tensors, a fake world: nothing "
        "allocated) and decide 'fits' by the traced peak; --no-trace: the formula decides "
        "(default: trace when --model is given)",
    )


def maybe_trace(
    a: argparse.Namespace, plan: Plan, m: Model, t: Training, c: Cluster
) -> Any:  # TracedPlan | None (torch is imported only here)
    if not a.model or not a.trace or not m.has_shape:
        return None
    from meshrun.plan.model_source import build_model, parse_kwargs
    from meshrun.plan.traced import trace_plan

    built = build_model(a.model, parse_kwargs(a.model_kwargs))
    return trace_plan(built.model, plan, m, t, c, a.top)


def print_traces(traced: Any, c: Cluster) -> None:
    if traced is None:
        return
    from meshrun.plan.traced import needed

    print(
        f"traced memory (reserved peak + {c.allowance_bytes / 1e9:.1f} GB allowance; "
        f"{traced.seconds:.1f} s to trace):"
    )
    for i, e in enumerate(traced.plan.estimates, 1):
        x = traced.traced.get(i - 1)
        if x is None:
            continue
        parts = " ".join(f"{k} {v / 1e9:.1f}" for k, v in x.parts.items())
        print(
            f"  #{i}: traced {needed(x, c) / 1e9:.1f} GB (allocated {x.allocated / 1e9:.1f}, "
            f"reserved {x.reserved / 1e9:.1f}: {parts}), formula {e.memory.total / 1e9:.1f} "
            f"GB, {'fits' if e.fits else 'does NOT fit'} in {c.memory_bytes / 1e9:.1f} GB; "
            f"blocks traced {'/'.join(map(str, x.blocks))}, {x.seconds:.1f} s"
        )
    sys.stdout.flush()


def add_json(doc: dict[str, Any], traced: Any, c: Cluster) -> None:
    if traced is None:
        return
    from meshrun.plan.traced import needed

    doc["trace_s"] = round(traced.seconds, 2)
    for i, row in enumerate(doc["layouts"]):
        x = traced.traced.get(i)
        if x is not None:
            row["traced_memory_gb"] = {**x.as_gb(), "needed": round(needed(x, c) / 1e9, 3)}
            row["trace_s"] = round(x.seconds, 2)
