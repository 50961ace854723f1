"""``meshrun plan --model``'s traced memory: the flags, the traces, their table and JSON."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from meshrun.plan.cost import Cluster, Estimate, Model, Training
from meshrun.plan.search import Plan

if TYPE_CHECKING:  # torch loads only when a trace runs
    from meshrun.parallel.memory_trace import Traced, TraceLayout


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

    built = build_model(a.model, parse_kwargs(a.model_kwargs))
    return trace_plan(built.model, plan, m, t, c, a.top)


def print_traces(traced: Any, c: Cluster) -> None:
    if traced is None:
        return
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
    doc["trace_s"] = round(traced.seconds, 2)
    for i, row in enumerate(doc["layouts"]):
        x = traced.traced.get(i)
        if x is not None:
            row["traced_memory_gb"] = {**x.as_gb(), "needed": round(needed(x, c) / 1e9, 3)}
            row["trace_s"] = round(x.seconds, 2)


# --- the plan re-decided by the trace -------------------------------------------------------
@dataclass
class TracedPlan:
    """A plan re-decided by the trace: ``traced[i]`` is the trace of ``plan.estimates[i]``
    (absent where not traced), ``seconds`` the time all traces took."""

    plan: Plan
    traced: dict[int, Traced]
    seconds: float


def trace_layout(e: Estimate, m: Model, t: Training, gpu: bool = True) -> TraceLayout | None:
    """What one rank of ``e``'s layout runs, or None where the trace cannot run it."""
    from meshrun.parallel.memory_trace import TraceLayout

    lay = e.layout
    if lay.cp > 1 or lay.ep > 1 or not m.has_shape:
        return None
    return TraceLayout(
        dp_replicate=lay.dp_replicate,
        dp_shard=lay.dp_shard,
        tp=lay.tp,
        pp=lay.pp,
        zero=lay.zero,
        micro_batch=lay.micro_batch,
        seq=m.seq,
        ac=lay.activation_checkpointing,
        precision=t.precision,
        optimizer=t.optimizer,
        microbatches=e.microbatches if lay.pp > 1 else 1,  # each stage's share: trace_stages
        schedule=lay.schedule,
        virtual=lay.vpp,  # interleaved: each rank's stages traced together
        gpu=gpu,
    )


def trace_plan(
    model: Any, plan: Plan, m: Model, t: Training, c: Cluster, top: int, gpu: bool = True
) -> TracedPlan:
    """Trace the first ``top`` layouts of ``plan`` (0: all) and decide their fit by the
    trace; the plan comes back re-ranked."""
    from meshrun.parallel.memory_trace import trace

    traced: dict[int, Traced] = {}
    cache: dict[TraceLayout, Traced] = {}
    estimates = list(plan.estimates)
    failed: str | None = None  # a model the trace cannot drive fails every layout alike
    for i, e in enumerate(estimates[: top or None]):
        lay = trace_layout(e, m, t, gpu)
        if lay is None or failed is not None:
            why = failed or "context/expert parallel"
            e.notes.append(f"not traced ({why}): the formula decides")
            continue
        if lay not in cache:
            try:
                cache[lay] = trace(model, lay)
            except Exception as err:
                failed = f"{type(err).__name__}: {first_line(err)}"
                e.notes.append(f"not traced ({failed}): the formula decides")
                continue
        traced[i] = cache[lay]
        estimates[i] = decide(e, cache[lay], c)
    order = sorted(range(len(estimates)), key=lambda i: _rank(estimates[i]))
    ranked = Plan(plan.params, [estimates[i] for i in order], plan.evaluated)
    remap = {new: traced[old] for new, old in enumerate(order) if old in traced}
    return TracedPlan(ranked, remap, sum(x.seconds for x in cache.values()))


def decide(e: Estimate, traced: Traced, c: Cluster) -> Estimate:
    """``e`` with "fits" decided by the traced reserved peak plus the allowance."""
    fits = traced.reserved + c.allowance_bytes <= c.memory_bytes
    note = f"formula {e.memory.total / 1e9:.1f} GB, traced {needed(traced, c) / 1e9:.1f} GB"
    return replace(e, fits=fits, notes=[*e.notes, note])


def needed(traced: Traced, c: Cluster) -> float:
    """Bytes the layout needs on one GPU by the trace: reserved peak plus the allowance."""
    return traced.reserved + c.allowance_bytes


def _rank(e: Estimate) -> tuple[float, ...]:
    speed = -e.tokens_per_s if e.time is not None and e.fits else e.memory.total
    return (not e.fits, speed)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else "no message"
