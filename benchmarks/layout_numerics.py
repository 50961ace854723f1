"""Every layout against one process, with clipping on: the table of docs/parallel.md
("Layouts against one process").

```
.venv/bin/python benchmarks/layout_numerics.py [--steps 20] [--layouts DDP,TP] [--out r.json]
```

Three models of the ported scripts' shapes (tests/ported_models.py: word_language_model's
tied LSTM, a tied causal ``nn.TransformerEncoder`` LM with a 4,096-token vocabulary, a Qwen2
with a 257-token vocabulary) train ``--steps`` steps through ``meshrun.init`` as a user script
does (SGD, ``optim.grad_clip`` below every step's norm), on CPU Gloo ranks (2, or 4 for HSDP,
FSDP x TP and PP x DP). Each cell is the largest per-step relative difference of the logged
loss to one process (and, in the second table, of the logged ``grad_norm``), or the refusal
meshrun printed before step 1. One spawn per layout runs the three models one after the other.
A cell above 1e-6 is marked; the script exits 1 if any is above 1e-4.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import ported_models as ln  # noqa: E402  (tests/ on the path first)
from _dist import free_port, run_distributed  # noqa: E402

MODELS = ("lstm", "transformer", "qwen2-257")
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "DDP": (2, {"zero": 0}),
    "ZeRO-1": (2, {"zero": 1}),
    "ZeRO-2": (2, {"zero": 2}),
    "ZeRO-3": (2, {"zero": 3}),
    "HSDP 2 x 2": (4, {"zero": 3, "dp_replicate": 2, "dp_shard": 2}),
    "TP 2": (2, {"tp": 2}),
    "TP 2 (feed-forward plan)": (2, {"tp": 2}),  # the transformer only: see OPTIONS
    "FSDP 2 x TP 2": (4, {"zero": 3, "tp": 2}),
    "PP 2": (2, {"pp": 2, "pp_microbatches": 2}),
    "PP 2 x DP 2": (4, {"pp": 2, "pp_microbatches": 2}),
    "AC + ZeRO-3": (2, {"zero": 3, "activation_checkpoint": 1}),
}
# torch's nn.MultiheadAttention is refused under TP (its q/k/v are one fused Parameter); the
# refusal names this plan for the feed-forward: the row runs it, on that model only.
FFN_PLAN = {"encoder.layers.*.linear1": "colwise", "encoder.layers.*.linear2": "rowwise"}
OPTIONS = {"TP 2 (feed-forward plan)": {"transformer": {"tp_plan": FFN_PLAN}}}
FLAG, LIMIT = 1e-6, 1e-4


Case = tuple[str, Any, dict[str, Any]]  # model, Config, run.parallelize keywords


def run_models(rank: int, world: int, cases: list[Case], ports: list[int]) -> Any:
    """One spawned rank: the models one after the other, each in its own ``meshrun.init``
    (a fresh process group on its own port: the previous run destroyed its own)."""
    out = []
    for (model, cfg, options), port in zip(cases, ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        out.append(ln.train(rank, world, model, cfg, options))
    return out


def launch(name: str, models: list[str], steps: int) -> list[Any]:
    world, fields = LAYOUTS[name] if name else (1, {})
    options = OPTIONS.get(name, {})
    d = tempfile.mkdtemp(prefix="meshrun-numerics-")
    cases = [
        (m, ln.make_config(f"{d}/{m}", m, fields, world, steps), options.get(m, {})) for m in models
    ]
    ports = [free_port() for _ in cases]
    return run_distributed(run_models, world, cases, ports, timeout=1800)[0]


def launch_each(name: str, steps: int) -> dict[str, Any]:
    """The layout's models in one spawn; if it fails, each alone, so a crash is named."""
    models = list(OPTIONS.get(name, MODELS))
    try:
        return dict(zip(models, launch(name, models, steps), strict=True))
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
    out: dict[str, Any] = {}
    for m in models:
        try:
            out[m] = launch(name, [m], steps)[0]
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            last = [x for x in str(e).splitlines() if x.strip()][-1:]
            out[m] = {"error": last[0] if last else type(e).__name__}
    return out


def short(reason: str) -> str:
    """The refusal's first clause (up to its first ';'), at most 200 characters, for a cell."""
    first = reason.replace("|", "/").replace("\n", " ").split(";")[0]
    return first if len(first) <= 200 else first[:197] + "..."


def cell(got: dict[str, Any], ref: dict[str, Any], key: str) -> tuple[str, float]:
    if "refused" in got:
        return "refused: " + short(got["refused"]), 0.0
    if "error" in got:
        return "**error: " + got["error"].replace("|", "/") + "**", float("inf")
    worst = ln.max_rel(got[key], ref[key])
    text = f"{worst:.1e}"
    if worst > LIMIT:
        text = f"**{text} (above 1e-4)**"
    elif worst > FLAG:
        text = f"{text} (above 1e-6)"
    return text, worst


def table(results: dict[str, dict[str, Any]], refs: dict[str, Any], key: str) -> list[str]:
    lines = ["| layout | ranks | " + " | ".join(MODELS) + " |", "|---|---|---|---|---|"]
    for name, per_model in results.items():
        cells = [cell(per_model[m], refs[m], key)[0] if m in per_model else "-" for m in MODELS]
        lines.append(f"| {name} | {LAYOUTS[name][0]} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated names")
    ap.add_argument("--out", type=Path, help="write every figure as JSON")
    args = ap.parse_args()
    names = [n.strip() for n in args.layouts.split(",")]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"--layouts: unknown {unknown}; choose from {list(LAYOUTS)}")
    t0 = time.time()
    refs = dict(zip(MODELS, launch("", list(MODELS), args.steps), strict=True))
    results = {}
    for name in names:
        results[name] = launch_each(name, args.steps)
        print(f"{name}: done at {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"Max relative difference of the logged loss to one process over {args.steps} steps")
    print("\n".join(table(results, refs, "losses")))
    print("\nThe same for the logged grad_norm (before clipping)")
    print("\n".join(table(results, refs, "grad_norms")))
    refusals = {
        (n, m): got["refused"]
        for n, per in results.items()
        for m, got in per.items()
        if "refused" in got
    }
    if refusals:
        print("\nThe refusals in full:")
        for (name, model), reason in refusals.items():
            print(f"- {name}, {model}: {reason}")
    if args.out:
        args.out.write_text(json.dumps({"refs": refs, "results": results}, indent=1))
    worst = max(
        (
            cell(got, refs[m], k)[1]
            for per in results.values()
            for m, got in per.items()
            for k in ("losses", "grad_norms")
        ),
        default=0.0,
    )
    return 1 if worst > LIMIT else 0


if __name__ == "__main__":
    sys.exit(main())
