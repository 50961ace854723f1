"""``meshrun plan``: the command line of the planner (arguments in, a table or JSON out)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from meshrun.cli import plan_links, plan_moe, plan_trace
from meshrun.cli.plan_checks import SHAPE_FLAGS, check_plan_numbers
from meshrun.cli.plan_emit import emit_config
from meshrun.plan.cost import GB, Cluster, Estimate, Model, Recompute, Training
from meshrun.plan.errors import PlanError
from meshrun.plan.search import Plan, evaluate_one, parse_layout, search, what_would_fit
from meshrun.plan.user_model import Inferred, format_count, model_from_spec
from meshrun.specs.gpus import GB_S, GPUS, TERA, get_gpu

CALIBRATION_KEYS = {f.name for f in dataclasses.fields(Cluster)} - {"nodes", "gpus_per_node"}


# --- arguments -> inputs -------------------------------------------------------------------


def _model(a: argparse.Namespace) -> tuple[Model, Inferred | None]:
    shape = {k: getattr(a, k) for k in SHAPE_FLAGS if getattr(a, k) is not None}
    if a.model_kwargs is not None and not a.model:
        raise PlanError(
            f"--model-kwargs {a.model_kwargs!r} gives arguments to --model's "
            "factory (or config.json fields): add --model, or drop it"
        )
    if a.params is not None:
        if shape or a.model:
            raise PlanError(
                "--params N is a bare parameter count: give it alone, or a shape "
                "(--layers ...) / --model instead"
            )
        if a.params < 1:
            raise PlanError(f"--params {a.params:g} is not allowed: must be >= 1")
        return Model(params=int(a.params)), None
    if a.model:
        inferred = model_from_spec(a.model, a.model_kwargs, shape, a.mlp)
        return inferred.model, inferred
    missing = [
        f"--{k.replace('_', '-')}"
        for k in ("layers", "hidden", "heads", "vocab", "seq")
        if k not in shape
    ]
    if missing:
        raise PlanError(
            f"the model shape is incomplete: missing {', '.join(missing)} "
            "(or give --params N, or --model path/to/model.py:factory)"
        )
    return Model(**shape, gated_mlp=a.mlp == "gated"), None


def _cluster(a: argparse.Namespace) -> Cluster:
    if a.nodes < 1 or a.gpus_per_node < 1:
        raise PlanError(f"--nodes {a.nodes} / --gpus-per-node {a.gpus_per_node}: must be >= 1")
    gpu = get_gpu(a.gpu)
    values: dict[str, Any] = {
        "memory_bytes": gpu.memory_gb * GB,
        "peak_flops": gpu.peak_flops(a.precision),
        "intra_bw": gpu.intra_bw,
        "inter_bw": gpu.inter_bw,
        "mem_bw": gpu.mem_bw,
        "intra_latency": gpu.intra_latency,
        "inter_latency": gpu.inter_latency,
    }
    if a.calibration:
        values.update(read_calibration(a.calibration))
    flags = {
        "memory_bytes": _scaled(a.gpu_memory_gb, GB),
        "peak_flops": _scaled(a.peak_tflops, TERA),
        "intra_bw": _scaled(a.intra_bw, GB_S),
        "inter_bw": _scaled(a.inter_bw, GB_S),
        "compute_efficiency": a.compute_efficiency,
        "comm_efficiency": a.comm_efficiency,
        "overlap": a.overlap,
        "allowance_bytes": _scaled(a.allowance_gb, GB),
        "intra_latency": _scaled(a.intra_latency_us, 1e-6),
        "inter_latency": _scaled(a.inter_latency_us, 1e-6),
    }
    values.update({k: v for k, v in flags.items() if v is not None})
    _check_cluster_values(values)
    return Cluster(nodes=a.nodes, gpus_per_node=a.gpus_per_node, **values)


def _scaled(value: float | None, unit: float) -> float | None:
    return None if value is None else value * unit


_ZERO_OK = (
    "overlap",
    "allowance_bytes",
    "fragmentation",
    "intra_latency",
    "inter_latency",
    "optimizer_bw",
    "tp_layer_overhead",
    "fsdp_unit_overhead",
)


def _check_cluster_values(values: dict[str, Any]) -> None:
    for key, value in values.items():
        fraction = key in ("compute_efficiency", "comm_efficiency", "overlap")
        low_ok = value >= 0 if key in _ZERO_OK else value > 0
        if not low_ok or (fraction and value > 1):
            allowed = "in (0, 1]" if fraction else "> 0"
            raise PlanError(f"{key} = {value!r} is not allowed: must be {allowed}")


def read_calibration(path: str) -> dict[str, float]:
    """A calibration file: JSON with any of the Cluster's rate fields (see docs/plan.md)."""
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"--calibration {path!r} does not exist; write one with `meshrun bench`")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise PlanError(f"--calibration {path!r} is not valid JSON: {e}") from None
    values = data.get("cluster", data) if isinstance(data, dict) else None
    if not isinstance(values, dict):
        raise PlanError(f"--calibration {path!r}: expected a JSON object")
    unknown = set(values) - CALIBRATION_KEYS - {"source", "measured"}
    if unknown:
        raise PlanError(
            f"--calibration {path!r}: unknown keys {sorted(unknown)}; allowed: "
            f"{sorted(CALIBRATION_KEYS)}"
        )
    return {k: float(v) for k, v in values.items() if k in CALIBRATION_KEYS}


def _recompute_list(text: str) -> list[Recompute]:
    allowed: tuple[Recompute, ...] = ("none", "selective", "full")
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise PlanError(f"--ac {text!r}: expected some of {', '.join(allowed)}")
    return [v for v in allowed if v in values]


# --- output --------------------------------------------------------------------------------


def estimate_json(e: Estimate) -> dict[str, Any]:
    """One layout in the ``--json`` schema (docs/plan.md)."""
    out: dict[str, Any] = dataclasses.asdict(e.layout)
    out["grad_accumulation"] = e.microbatches
    out["fits"] = e.fits
    out["memory_gb"] = e.memory.as_gb()
    t = e.time
    out["step_time_s"] = None if t is None else t.total
    out["step_time_breakdown_s"] = (
        None
        if t is None
        else {
            "compute": t.compute,
            "exposed_comm": t.exposed_comm,
            "bubble": t.bubble,
            "dp_comm": t.dp_comm,
            "dp_exposed": t.dp_exposed,
            "tp_comm": t.tp_comm,
            "pp_comm": t.pp_comm,
            "optimizer": t.optimizer,
            "tp_overhead": t.tp_overhead,
            "fsdp_overhead": t.fsdp_overhead,
            "ep_comm": t.ep_comm,
            "cp_comm": t.cp_comm,
        }
    )
    out["tokens_per_s"] = None if t is None else e.tokens_per_s
    out["mfu"] = None if t is None else e.mfu
    out["notes"] = e.notes
    out.update(plan_moe.band_json(e))
    return out


def plan_json(plan: Plan, c: Cluster, t: Training, top: int, advice: list[str]) -> dict[str, Any]:
    shown = plan.estimates[:top] if top else plan.estimates
    return {
        "params": plan.params,
        "gpus": c.world,
        "evaluated": plan.evaluated,
        "cluster": dataclasses.asdict(c),
        "training": dataclasses.asdict(t),
        "layouts": [estimate_json(e) for e in shown],
        "what_would_fit": advice,
    }


def print_table(plan: Plan, c: Cluster, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    timed = plan.estimates[0].time is not None
    shown = plan.estimates[: top or None]
    extra = plan_moe.columns(shown)  # ep, cp: only when a layout shown uses them
    table = Table(
        title=f"{format_count(plan.params)} parameters on {c.world} GPUs: "
        f"{len(plan.fitting)} of {plan.evaluated} layouts fit"
    )
    for col in (
        "#",
        "dp_rep",
        "dp_shard",
        "tp",
        "pp",
        *extra,
        "zero",
        "mb",
        "ac",
        "accum",
        "fits",
        "mem GB p/g/o/act/buf",
        "total GB",
    ):
        table.add_column(col, justify="right")
    if timed:
        for col in (
            "step s",
            "comp/comm/bubble s",
            "tokens/s",
            "MFU",
            *plan_moe.band_columns(shown),
        ):
            table.add_column(col, justify="right")
    for i, e in enumerate(shown, 1):
        table.add_row(*_row(i, e, extra))
    Console(width=200).print(table)


def _row(i: int, e: Estimate, extra: list[str]) -> list[str]:
    lay, g = e.layout, e.memory.as_gb()
    parts = "/".join(
        f"{g[k]:.1f}" for k in ("params", "grads", "optimizer", "activations", "buffers")
    )
    row = [
        str(i),
        str(lay.dp_replicate),
        str(lay.dp_shard),
        str(lay.tp),
        str(lay.pp),
        *(str(getattr(lay, k)) for k in extra),
        str(lay.zero),
        str(lay.micro_batch),
        lay.activation_checkpointing,
        str(e.microbatches),
        "yes" if e.fits else "NO",
        parts,
        f"{g['total']:.1f}",
    ]
    if e.time is not None:
        t = e.time
        row += [
            f"{t.total:.3f}",
            f"{t.compute:.3f}/{t.exposed_comm:.3f}/{t.bubble:.3f}",
            f"{e.tokens_per_s:,.0f}",
            f"{e.mfu:.1%}",
            *plan_moe.band_cells(e),
        ]
    return row


# --- --emit-config ---------------------------------------------------------------------------


# --- the command ---------------------------------------------------------------------------


def cmd_plan(a: argparse.Namespace) -> int:
    check_plan_numbers(a)
    model, inferred = _model(a)
    model = plan_moe.apply_moe_args(a, model)
    if inferred is not None:  # what was read from the model, before the layouts built on it
        print("\n".join(inferred.lines), file=sys.stderr if a.json else sys.stdout)
    if a.global_batch < 1:
        raise PlanError(f"--global-batch {a.global_batch} is not allowed: must be >= 1")
    training = plan_moe.training_args(a)
    cluster = plan_links.apply_link_flags(a, _cluster(a))
    start = time.perf_counter()
    micro, recompute = plan_moe.int_list(a.micro_batch, "--micro-batch"), _recompute_list(a.ac)
    if a.layout:
        plan = evaluate_one(model, parse_layout(a.layout, cluster), training, cluster)
    else:
        eps, cps = plan_moe.searched_sizes(a)
        plan = search(model, training, cluster, micro, recompute, eps, cps)
    traced = plan_trace.maybe_trace(a, plan, model, training, cluster)
    plan = plan if traced is None else traced.plan
    advice = [] if plan.fitting else what_would_fit(model, training, cluster, plan)
    links = plan_links.links_report(a, model, training, cluster, plan.fitting[:1])  # --diloco
    elapsed = time.perf_counter() - start
    if a.json:
        doc = plan_json(plan, cluster, training, a.top, advice)
        doc["search_s"] = round(elapsed, 4)
        plan_trace.add_json(doc, traced, cluster)
        if inferred is not None:
            doc["model"] = inferred.json
        if links is not None:
            doc["slow_links"] = links[1]
        print(json.dumps(doc, indent=2))
    else:
        print_table(plan, cluster, a.top)
        shown = plan.estimates[: a.top or None]
        print("\n".join(plan_moe.routing_lines(model, shown, a.moe_imbalance_source)))
        plan_trace.print_traces(traced, cluster)
        for line in advice:
            print(f"nothing fits; {line}" if line is advice[0] else f"  - {line}")
        if links is not None:
            print("\n".join(links[0]))
    if a.plot:
        _plot(a.plot, plan, model, training, cluster, micro, recompute, a.json)
    return _maybe_emit(a, plan, training)


def _plot(
    path: str,
    plan: Plan,
    m: Model,
    t: Training,
    c: Cluster,
    micro: list[int],
    recompute: list[Recompute],
    quiet: bool,
) -> None:
    from meshrun.plan.plot import check_plottable, plot_plan, scaling

    check_plottable(plan)  # before the searches at every node count
    plot_plan(path, plan, c, scaling(m, t, c, micro, recompute))
    print(f"wrote {path}", file=sys.stderr if quiet else sys.stdout)


def _maybe_emit(a: argparse.Namespace, plan: Plan, t: Training) -> int:
    if not a.emit_config:
        return 0
    if not plan.fitting:
        print(
            f"meshrun plan: no config written to {a.emit_config}: no layout fits", file=sys.stderr
        )
        return 1
    missing = emit_config(plan.fitting[0], t, a.emit_config)
    out = sys.stderr if a.json else sys.stdout
    print(
        f"wrote {a.emit_config} (layout #1); run it with `meshrun launch --config "
        f"{a.emit_config} train.py`",
        file=out,
    )
    for item in missing:
        print(f"  not in meshrun's config yet, set it in your script: {item}", file=out)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="recommend a parallel layout: memory, step time and MFU for a model and cluster",
        description="Enumerate layouts (dp_replicate x dp_shard x tp x pp, ZeRO stage, "
        "micro-batch, activation checkpointing), drop those that do not fit memory and rank "
        "the rest by predicted tokens/s. Formulas and sources: docs/plan.md.",
    )
    m = p.add_argument_group("model (a shape, --params, or --model)")
    for flag in SHAPE_FLAGS:
        m.add_argument(f"--{flag.replace('_', '-')}", type=int, dest=flag, help=_SHAPE_HELP[flag])
    m.add_argument(
        "--mlp",
        choices=["plain", "gated"],
        help="plain (GELU, 2 matrices; the "
        "default) or gated (SwiGLU, 3 matrices); --model: read from its blocks",
    )
    m.add_argument(
        "--params", type=float, help="bare parameter count, e.g. 7.5e9 (model states only)"
    )
    m.add_argument(
        "--model",
        help="a model to plan for, built on the meta device (nothing "
        "allocated or downloaded): path/to/model.py:factory, pkg.module:factory, or a "
        "Hugging Face config.json or its directory; prints the shape it reads",
    )
    m.add_argument(
        "--model-kwargs",
        metavar="JSON",
        help="keyword arguments of --model's factory"
        """ ('{"n_layer": 12}'), or fields over its config.json""",
    )
    tr = p.add_argument_group("training")
    tr.add_argument("--global-batch", type=int, default=512, help="sequences per step (512)")
    tr.add_argument("--micro-batch", default="1,2,4,8,16,32", help="candidates (1,2,...,32)")
    tr.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    tr.add_argument("--optimizer", choices=["adam", "adamw", "sgd"], default="adamw")
    tr.add_argument(
        "--attention",
        choices=["fused", "eager"],
        default="fused",
        help="fused (SDPA/flash: no s*s scores stored) or eager (default fused)",
    )
    tr.add_argument(
        "--ac",
        default="none,selective,full",
        help="activation checkpointing modes to consider (none,selective,full)",
    )
    plan_moe.add_moe_args(p)
    plan_trace.add_arguments(p)
    _add_cluster_args(p)
    plan_links.add_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument(
        "--layout",
        help="evaluate one layout: dp_shard=64,zero=1,tp=8,micro_batch=2"
        ",activation_checkpointing=full (dp_shard left out = the rest)",
    )
    o.add_argument("--top", type=int, default=5, help="layouts shown (0 = all; default 5)")
    o.add_argument("--json", action="store_true", help="JSON output (schema in docs/plan.md)")
    o.add_argument("--emit-config", metavar="FILE", help="write the best layout's meshrun config")
    o.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw the layouts' memory vs step time and "
        "the best layout's tokens/s and scaling efficiency vs nodes (matplotlib)",
    )
    p.set_defaults(fn=cmd_plan)


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cluster (table values overridable)")
    c.add_argument("--nodes", "--nnodes", type=int, default=1, help="nodes (1)")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (8)")
    c.add_argument("--gpu", default="h100-sxm", help=f"one of {', '.join(GPUS)} (h100-sxm)")
    c.add_argument("--gpu-memory-gb", type=float, help="memory per GPU, GB (1e9 bytes)")
    c.add_argument("--peak-tflops", type=float, help="peak dense TFLOP/s at --precision")
    c.add_argument("--intra-bw", type=float, help="GB/s per GPU inside a node")
    c.add_argument("--inter-bw", type=float, help="GB/s per GPU between nodes")
    c.add_argument(
        "--intra-latency-us",
        type=float,
        help="latency per ring step inside a node, microseconds (alpha of the alpha-beta model)",
    )
    c.add_argument(
        "--inter-latency-us", type=float, help="latency per ring step between nodes, microseconds"
    )
    c.add_argument("--compute-efficiency", type=float, help="achievable fraction of peak (0.5)")
    c.add_argument("--comm-efficiency", type=float, help="achievable fraction of link bw (0.7)")
    c.add_argument("--overlap", type=float, help="share of the hiding window DP comm uses (0.8)")
    c.add_argument("--allowance-gb", type=float, help="context/NCCL/allocator reserve, GB (1)")
    c.add_argument("--calibration", metavar="FILE", help="JSON from `meshrun bench`")


_SHAPE_HELP = {
    "layers": "transformer blocks (l)",
    "hidden": "hidden size (h)",
    "heads": "attention heads (a)",
    "kv_heads": "key/value heads (GQA; default = heads)",
    "ffn": "MLP width (default 4*hidden)",
    "vocab": "vocabulary size (V)",
    "seq": "sequence length (s)",
}

__all__ = ["add_parser", "cmd_plan", "read_calibration"]
