"""``meshrun plan --model``: the user's model as the planner's :class:`Model`, and what was
inferred about it, line by line with the source of each figure.

Command-line shape flags win over what the model says; what neither says is an error naming
the flags to pass. Imports no torch until a model is built (model_source, inspect_model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

from meshrun.plan.cost import Model
from meshrun.plan.errors import PlanError
from meshrun.plan.inputs import Moe

REQUIRED = ("layers", "hidden", "heads", "vocab", "seq")
# How the user gives each field when the model does not say it.
FLAG_FOR = {
    "layers": "--layers",
    "hidden": "--hidden",
    "heads": "--heads",
    "kv_heads": "--kv-heads",
    "ffn": "--ffn",
    "vocab": "--vocab",
    "seq": "--seq",
}


def format_count(n: float) -> str:
    """A parameter count for people: 950, 107K, 6.7B, 70B (one decimal below 10)."""
    if n < 1000:
        return f"{n:.0f}"
    units = ((1e3, "K"), (1e6, "M"), (1e9, "B"), (1e12, "T"))
    for i, (unit, suffix) in enumerate(units):
        value = n / unit
        text = f"{value:.1f}" if value < 9.95 else f"{value:.0f}"
        if float(text) < 1000 or i == len(units) - 1:
            return text + suffix
    raise AssertionError("unreachable")


@dataclass
class Inferred:
    """The planner's model, and the lines (and JSON) that say where each figure came from."""

    model: Model
    lines: list[str]
    json: dict[str, Any]


def model_from_spec(
    spec: str, kwargs_text: str | None, flags: dict[str, int], mlp: str | None
) -> Inferred:
    """Build ``spec`` on the meta device, infer its shape, and apply the command line's
    ``flags`` (shape fields) and ``mlp`` (plain/gated; None: inferred) over it."""
    from meshrun.plan.inspect_model import inspect_module
    from meshrun.plan.model_source import build_model, parse_kwargs

    built = build_model(spec, parse_kwargs(kwargs_text))
    found = inspect_module(built.model, built.config)
    shape, sources = _merge(found.shape, found.sources, flags)
    _check_complete(spec, shape, found.params)
    params, layer_params = _exact_counts(found.shape, flags, found.params, found.layer_params)
    moe, head_dim = _moe(built.model, found, shape, bool(params))
    gated = mlp == "gated" if mlp is not None else bool(found.gated) or moe is not None
    if mlp is not None:
        sources["mlp"] = "--mlp"
    elif moe is not None and not found.gated:
        sources["mlp"] = "experts: gated assumed (the Hugging Face families' are SwiGLU)"
    else:
        sources["mlp"] = found.sources.get(
            "mlp", "not found in the blocks: plain assumed; --mlp gated for a SwiGLU MLP"
        )
    given: dict[str, Any] = dict(shape)  # ints only: typed Any for Model's other fields
    model = Model(
        **given,
        gated_mlp=gated,
        params=params,
        layer_params=layer_params,
        separate_qkv=bool(found.separate_qkv),
        moe=moe,
        head_dim=head_dim,
    )
    if moe is not None and not params:  # the shape formulas, experts included
        from meshrun.plan.moe import moe_model

        model = moe_model(model, moe)
    tied = [f"{a} = {b}" for a, b in found.tied]
    shown = {"kv_heads": shape.get("heads", 0), "ffn": 4 * shape.get("hidden", 0), **shape}
    facts = {
        "class": found.class_name,
        "params": found.params,
        "built_from": built.origin,
        "shape": {
            **shown,
            "tied": bool(tied),
            "mlp": "gated" if gated else "plain",
            "separate_qkv": model.separate_qkv,
        },
        "sources": {
            **sources,
            "tied": "; ".join(tied) or "no parameter under two names",
            "separate_qkv": found.sources.get("qkv", "not found: fused assumed"),
        },
    }
    lines = describe(spec, facts)
    if moe is not None:
        facts["moe"] = dataclasses.asdict(moe)
        lines.append(_moe_line(moe, found.config_source or "config"))
    if not params:
        lines.append(
            "  counts   from the shape formulas: the flags changed the model's shape "
            "(--model-kwargs builds it at that shape and keeps the exact counts)"
        )
    return Inferred(model, lines, {"spec": spec, **facts, "exact_counts": bool(params)})


def _moe(model: Any, found: Any, shape: dict[str, int], exact: bool) -> tuple[Moe | None, int]:
    """The experts the model declares (plan/moe.py) and its attention's width per head; the
    experts' exact count only while the model's counts are kept (no shape flag changed)."""
    from meshrun.plan.moe import attention_width, moe_of_module

    values, hidden = found.config_values, shape.get("hidden", 0)
    moe = moe_of_module(model, values, hidden, found.config_source or "config") if hidden else None
    if moe is not None and not exact:
        moe = replace(moe, expert_params=0)
    heads = shape.get("heads", 0)
    width = attention_width(values, hidden, heads) if heads else 0
    return moe, (width // heads if heads and width != hidden else 0)


def _moe_line(moe: Moe, where: str) -> str:

    routed = f"{format_count(moe.expert_params)} routed parameters" if moe.expert_params else ""
    shared = f", shared experts {moe.shared_ffn} wide" if moe.shared_ffn else ""
    return (
        f"  experts  {moe.experts:<9}top-{moe.top_k}, each {moe.expert_ffn} wide{shared}, in "
        f"{moe.moe_layers} layers ({where}; modules named experts{': ' + routed if routed else ''})"
    )


def _exact_counts(
    shape: dict[str, int], flags: dict[str, int], params: int, layer_params: int
) -> tuple[int, int]:
    """The counts of the model built, unless a flag changed a field they depend on (then 0:
    the planner's formulas count the shape the flags describe). The training length --seq
    changes no weight."""
    changed = [k for k, v in flags.items() if k != "seq" and k in shape and shape[k] != v]
    return (0, 0) if changed else (params, layer_params)


def _merge(
    shape: dict[str, int], sources: dict[str, str], flags: dict[str, int]
) -> tuple[dict[str, int], dict[str, str]]:
    merged, where = dict(shape), dict(sources)
    for key, value in flags.items():
        said = shape.get(key)
        where[key] = FLAG_FOR[key] + ("" if said in (None, value) else f" (the model says {said})")
        merged[key] = value
    if "seq" in merged and "seq" not in flags and "max_position" in where.get("seq", ""):
        where["seq"] += " (the longest it takes; --seq N for the length you train at)"
    if "kv_heads" not in merged:
        where["kv_heads"] = "= heads: none found (multi-head attention); --kv-heads N for GQA"
    if "ffn" not in merged:
        where["ffn"] = "= 4 x hidden: not found; --ffn N gives it"
    return merged, where


def _check_complete(spec: str, shape: dict[str, int], params: int) -> None:
    missing = [k for k in REQUIRED if k not in shape]
    if missing:
        raise PlanError(
            f"--model {spec}: found no {', '.join(missing)} (not in a config on the "
            "model nor on its blocks or embeddings); give "
            + " ".join(f"{FLAG_FOR[k]} N" for k in missing)
            + f", or --params {params} alone (model-state memory only)"
        )


def describe(spec: str, facts: dict[str, Any]) -> list[str]:
    """One line for the model, then one per inferred field: value and source."""
    shape, sources = facts["shape"], facts["sources"]
    lines = [
        f"model {spec}: {facts['class']}, {format_count(facts['params'])} parameters "
        f"({facts['params']:,}; built on the meta device from its {facts['built_from']})"
    ]
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
        value = shape.get(key, "-")
        lines.append(f"  {key.replace('_', '-'):<9}{value!s:<9}{sources.get(key, '')}")
    lines.append(f"  {'tied':<9}{'yes' if shape['tied'] else 'no':<9}{sources['tied']}")
    lines.append(f"  {'mlp':<9}{shape['mlp']:<9}{sources['mlp']}")
    qkv = "separate" if shape["separate_qkv"] else "fused"
    lines.append(f"  {'q/k/v':<9}{qkv:<9}{sources['separate_qkv']}")
    return lines


__all__ = ["Inferred", "format_count", "model_from_spec"]
