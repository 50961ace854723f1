"""``meshrun plan``'s flags for mixture-of-experts models and long sequences: the experts of a
shape given by flags, expert- and context-parallel sizes to search, and their table columns."""

from __future__ import annotations

import argparse
from dataclasses import replace

from meshrun.plan.cost import Estimate, Model, Training
from meshrun.plan.errors import PlanError
from meshrun.plan.inputs import Moe
from meshrun.plan.moe import moe_model

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
    return model


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


__all__ = ["add_moe_args", "apply_moe_args", "columns", "int_list", "parallel_sizes"]


def training_args(a: argparse.Namespace) -> Training:
    """The training settings of ``meshrun plan``'s flags, with the MoE/CP ones."""
    fused = a.attention == "fused"
    extra = {"cp_attention": a.cp_attention, "ep_dispatch": a.ep_dispatch}
    return Training(a.global_batch, a.precision, a.optimizer, fused, **extra)


def searched_sizes(a: argparse.Namespace) -> tuple[list[int] | None, list[int]]:
    """The ep and cp degrees the search tries (``--ep``, ``--cp``; cp 1 when unset)."""
    return parallel_sizes(a.ep, "--ep"), parallel_sizes(a.cp, "--cp") or [1]
