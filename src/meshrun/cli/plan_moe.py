"""``meshrun plan``'s flags for mixture-of-experts models and long sequences: the experts of a
shape given by flags, expert- and context-parallel sizes to search, and their table columns."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

from meshrun.cli.plan_imbalance import read_imbalance
from meshrun.plan.cost import Estimate, Model, Training
from meshrun.plan.errors import PlanError
from meshrun.plan.inputs import Moe, MoeRouting
from meshrun.plan.moe import moe_model

ROUTINGS = ("balanced", "dropless", "capacity")

MOE_FLAGS = ("experts", "top_k", "expert_ffn")


def add_moe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts and long sequences (docs/plan.md)")
    g.add_argument("--experts", type=int, help="routed experts per MoE layer (with a shape)")
    g.add_argument("--top-k", type=int, dest="top_k", help="experts each token is routed to")
    g.add_argument("--expert-ffn", type=int, dest="expert_ffn", help="one expert's MLP width")
    g.add_argument(
        "--shared-ffn", type=int, default=0, dest="shared_ffn", help="shared experts' width (0)"
    )
    g.add_argument(
        "--moe-layers",
        type=int,
        default=0,
        dest="moe_layers",
        help="layers with experts (0 = all; the rest dense MLPs of --ffn)",
    )
    g.add_argument(
        "--capacity-factor",
        type=float,
        dest="capacity_factor",
        help="expert slots per routed token (1.0 = dropless, no padding)",
    )
    g.add_argument(
        "--moe-routing",
        default="balanced",
        dest="moe_routing",
        help="how the router loads the experts: balanced (every expert at the mean), dropless "
        "(all tokens run; the busiest expert at --moe-imbalance x the mean) or capacity (an "
        "expert keeps --moe-capacity-factor x the mean, the rest are dropped)",
    )
    g.add_argument(
        "--moe-imbalance",
        dest="moe_imbalance",
        metavar="F|RUN_DIR",
        help="the busiest expert's tokens over the mean, >= 1, or a run directory (or its "
        "metrics.jsonl) whose logged moe_imbalance figures give it (their mean); needed by "
        "dropless; capacity: 1.0 when unset",
    )
    g.add_argument(
        "--moe-capacity-factor",
        type=float,
        dest="moe_capacity_factor",
        help="with --moe-routing capacity: tokens an expert keeps, over the mean (> 0)",
    )
    g.add_argument("--head-dim", type=int, dest="head_dim", help="attention width per head")
    g.add_argument(
        "--ep",
        help="expert-parallel sizes to consider, e.g. 1,8 (default for an MoE model: every "
        "divisor of its experts up to 64 that divides dp_shard x cp)",
    )
    g.add_argument(
        "--ep-dispatch",
        choices=["all_to_all", "deepep"],
        default="all_to_all",
        dest="ep_dispatch",
        help="expert parallel's dispatcher: all_to_all (every routed copy sent) or deepep "
        "(a token sent once per remote node, forwarded over NVLink)",
    )
    g.add_argument("--cp", default="1", help="context-parallel sizes to consider (1), e.g. 1,2,4")
    g.add_argument(
        "--cp-attention",
        choices=["ring", "ulysses"],
        default="ring",
        dest="cp_attention",
        help="context parallel's attention: ring (K/V passed around) or ulysses (all-to-all)",
    )


def apply_moe_args(a: argparse.Namespace, model: Model) -> Model:
    """The model with the experts and the head width the flags give, and the capacity factor."""
    given = [f"--{k.replace('_', '-')}" for k in MOE_FLAGS if getattr(a, k) is not None]
    if a.head_dim is not None:
        if a.head_dim < 1:
            raise PlanError(f"--head-dim {a.head_dim} is not allowed: must be >= 1")
        model = replace(model, head_dim=a.head_dim)
    if given:
        model = _with_experts(a, model, given)
    if a.capacity_factor is not None:
        if a.capacity_factor < 1.0:
            raise PlanError(
                f"--capacity-factor {a.capacity_factor:g} is not allowed: must be >= 1.0 "
                "(below it tokens are dropped, which the cost model does not count)"
            )
        if model.moe is None:
            raise PlanError("--capacity-factor needs an MoE model: add --experts/--top-k/...")
        model = replace(model, moe=replace(model.moe, capacity_factor=a.capacity_factor))
    routing = routing_args(a)
    if routing != MoeRouting():
        if model.moe is None:
            raise PlanError(
                f"--moe-routing {a.moe_routing} needs an MoE model: add --experts/--top-k/"
                "--expert-ffn, or a --model that declares experts"
            )
        model = replace(model, moe=replace(model.moe, routing=routing))
    return model


def _positive(flag: str, value: float | None, least: float, allowed: str) -> None:
    if value is not None and not (math.isfinite(value) and value >= least and value > 0):
        raise PlanError(f"{flag} {value:g} is not allowed: must be {allowed}")


def routing_args(a: argparse.Namespace) -> MoeRouting:
    """The routing of ``--moe-routing``/``--moe-imbalance``/``--moe-capacity-factor``,
    checked: each flag only where its routing reads it."""
    kind, c = a.moe_routing, a.moe_capacity_factor
    f, a.moe_imbalance_source = (
        (None, "") if a.moe_imbalance is None else read_imbalance(a.moe_imbalance)
    )
    if kind not in ROUTINGS:
        raise PlanError(
            f"--moe-routing {kind!r} is not allowed: choose {', '.join(ROUTINGS)} "
            "(e.g. --moe-routing dropless --moe-imbalance 1.3)"
        )
    _positive("--moe-imbalance", f, 1.0, ">= 1.0 (the busiest expert's tokens over the mean)")
    _positive("--moe-capacity-factor", c, 0.0, "> 0 (tokens an expert keeps, over the mean)")
    if f is not None and kind == "balanced":
        raise PlanError(
            f"--moe-imbalance {f:g} needs --moe-routing dropless or capacity: balanced routing "
            "puts every expert at the mean"
        )
    if c is not None and kind != "capacity":
        raise PlanError(
            f"--moe-capacity-factor {c:g} needs --moe-routing capacity (with {kind} routing no "
            "token is dropped); for padded slots without drops use --capacity-factor"
        )
    if kind == "dropless" and f is None:
        raise PlanError(
            "--moe-routing dropless needs --moe-imbalance F: the busiest expert's tokens over "
            "the mean (training's moe_imbalance metric), e.g. --moe-imbalance 1.3"
        )
    if kind == "capacity" and c is None:
        raise PlanError(
            "--moe-routing capacity needs --moe-capacity-factor C (tokens an expert keeps over "
            "the mean, e.g. 1.0), with --moe-imbalance F for the drops"
        )
    if kind == "capacity" and a.capacity_factor is not None:
        raise PlanError(
            f"--capacity-factor {a.capacity_factor:g} pads slots without dropping; with "
            "--moe-routing capacity give only --moe-capacity-factor"
        )
    return MoeRouting(kind, 1.0 if f is None else f, 0.0 if c is None else c)


def _with_experts(a: argparse.Namespace, model: Model, given: list[str]) -> Model:
    if model.moe is not None or not model.has_shape:
        raise PlanError(
            f"{', '.join(given)} describe experts of a shape given by flags (--layers ...): "
            + ("--model already declares its experts" if model.moe else "give the shape")
        )
    if len(given) < len(MOE_FLAGS):
        raise PlanError("an MoE shape needs --experts, --top-k and --expert-ffn together")
    moe = Moe(a.experts, a.top_k, a.expert_ffn, a.shared_ffn, a.moe_layers)
    if moe.experts < 2 or not 1 <= moe.top_k <= moe.experts or moe.expert_ffn < 1:
        raise PlanError(
            f"--experts {a.experts} --top-k {a.top_k} --expert-ffn {a.expert_ffn}: need "
            "experts >= 2, 1 <= top-k <= experts and expert-ffn >= 1"
        )
    if not 0 <= moe.moe_layers <= model.layers:
        raise PlanError(f"--moe-layers {a.moe_layers}: must be 0 (all) to --layers")
    return moe_model(model, moe)


def parallel_sizes(text: str | None, flag: str) -> list[int] | None:
    return None if text is None else int_list(text, flag)


def int_list(text: str, flag: str) -> list[int]:
    """``flag``'s comma-separated values, each an integer >= 1 (the planner's size lists)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(f"{flag} {text!r}: expected integers separated by commas") from None
    if not values or min(values) < 1:
        raise PlanError(f"{flag} {text!r}: every value must be >= 1")
    return values


def columns(estimates: list[Estimate]) -> list[str]:
    """ep and cp columns when a layout shown uses them (the dense table stays as it was)."""
    return [k for k in ("ep", "cp") if any(getattr(e.layout, k) > 1 for e in estimates)]


__all__ = [
    "add_moe_args",
    "apply_moe_args",
    "band_cells",
    "band_columns",
    "band_json",
    "columns",
    "int_list",
    "parallel_sizes",
    "routing_args",
    "routing_lines",
]


def band_columns(estimates: list[Estimate]) -> list[str]:
    """The routing band's column when a layout shown was planned with uneven routing."""
    return ["vs balanced"] if any(e.balanced_tokens_per_s for e in estimates) else []


def band_cells(e: Estimate) -> list[str]:
    """tokens/s under the routing given against balanced routing (the band's two ends)."""
    if not e.balanced_tokens_per_s:
        return []
    return [f"{e.balanced_tokens_per_s:,.0f} ({e.tokens_per_s / e.balanced_tokens_per_s - 1:+.1%})"]


def band_json(e: Estimate) -> dict[str, float]:
    if not e.balanced_tokens_per_s:
        return {}
    return {"balanced_tokens_per_s": e.balanced_tokens_per_s, "dropped_fraction": e.dropped}


def routing_lines(m: Model, estimates: list[Estimate], source: str = "") -> list[str]:
    """What the MoE rows assume of the routing, under the table (``source``: where a measured
    imbalance was read)."""
    if m.moe is None or not estimates or estimates[0].time is None:
        return []
    r = m.moe.routing
    if r.kind == "balanced":
        return [
            "routing: balanced (every expert at the mean: the fastest case, no band); give "
            "--moe-routing dropless --moe-imbalance F (training's moe_imbalance) for one"
        ]
    measured = f" ({source})" if source else ""
    what = f"dropless, the busiest expert at {r.imbalance:g} x the mean{measured}"
    if r.kind == "capacity":
        what = (
            f"capacity factor {r.capacity:g} with the busiest expert at {r.imbalance:g} x the "
            f"mean{measured}: {estimates[0].dropped:.1%} of the routed tokens dropped"
        )
    return [
        f"routing: {what}; tokens/s is under it, 'vs balanced' the same layout with every "
        "expert at the mean (the band: the busiest rank's expert compute, all-to-all and "
        "expert activations scale with its load)"
    ]


def training_args(a: argparse.Namespace) -> Training:
    """The training settings of ``meshrun plan``'s flags, with the MoE/CP ones."""
    fused = a.attention == "fused"
    extra = {"cp_attention": a.cp_attention, "ep_dispatch": a.ep_dispatch}
    return Training(a.global_batch, a.precision, a.optimizer, fused, **extra)


def searched_sizes(a: argparse.Namespace) -> tuple[list[int] | None, list[int]]:
    """The ep and cp degrees the search tries (``--ep``, ``--cp``; cp 1 when unset)."""
    return parallel_sizes(a.ep, "--ep"), parallel_sizes(a.cp, "--cp") or [1]
