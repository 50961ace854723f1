"""Same seed, same outputs? Run the demo under a list of layouts and compare two checkouts bitwise.

A refactor that claims "behaviour unchanged" must show it: this runs ``meshrun demo`` (the tiny
GPT, a few steps, fixed seed) under each layout, from the source tree given, and writes per
layout the per-step losses (``metrics.jsonl``, full float precision), the validation losses,
and SHA-256 digests of every checkpoint it left: each file but the manifest and its marker
(they hold a creation time), and each tensor of the last checkpoint loaded back through DCP
(the parameters and optimizer state, whatever the file bytes; DCP's ``.metadata`` is left out:
it differs between two runs of the same code). Every layout runs in the same
directory on both sides, so the saved config (which names it) is the same too.

    python benchmarks/compare_runs.py run --src /path/to/checkout/src --out before.json
    python benchmarks/compare_runs.py run --src src --out after.json
    python benchmarks/compare_runs.py compare before.json after.json   # exit 1 on a difference

Layouts: DDP 2, ZeRO-1 2, ZeRO-3 2, PP 2, DDP 2 with async interval saves, a resume (a DDP 2
run of 4 steps, then the same run directory continued to 8 steps from its checkpoint), and the
rest of docs/parallel.md's table: TP 2, and on 4 processes DDP, ZeRO-1/2/3, HSDP, ZeRO-3 x TP 2,
PP 2 x {ZeRO-3, DDP, ZeRO-1, TP 2}; and the three example loops of examples/ on 2 processes
(the Hugging Face one under ZeRO-3).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

STEPS = 6
COMMON = ["--size", "tiny", "--metrics.progress=false"]
# name -> list of (steps, overrides) launches in one run directory
LAYOUTS: dict[str, list[tuple[int, list[str]]]] = {
    "ddp2": [(STEPS, [])],
    "zero1_2": [(STEPS, ["--parallel.zero=1"])],
    "zero3_2": [(STEPS, ["--parallel.zero=3"])],
    "pp2": [(STEPS, ["--parallel.pp=2"])],
    "ddp2_async": [(STEPS, ["--checkpoint.interval=2", "--checkpoint.async=true"])],
    "resume_ddp2": [(4, ["--checkpoint.interval=2"]), (8, ["--checkpoint.interval=2"])],
    # The rest of docs/parallel.md's table (4 processes where it says so).
    "tp2": [(STEPS, ["--parallel.tp=2"])],
    "ddp4": [(STEPS, ["--nproc", "4"])],
    "zero1_4": [(STEPS, ["--nproc", "4", "--parallel.zero=1"])],
    "zero2_4": [(STEPS, ["--nproc", "4", "--parallel.zero=2"])],
    "zero3_4": [(STEPS, ["--nproc", "4", "--parallel.zero=3"])],
    "hsdp4": [(STEPS, ["--nproc", "4", "--parallel.zero=3", "--parallel.dp_replicate=2"])],
    "zero3_tp2_4": [(STEPS, ["--nproc", "4", "--parallel.zero=3", "--parallel.tp=2"])],
    "pp2_zero3_4": [(STEPS, ["--nproc", "4", "--parallel.pp=2", "--parallel.zero=3"])],
    "pp2_ddp_4": [(STEPS, ["--nproc", "4", "--parallel.pp=2"])],
    "pp2_zero1_4": [(STEPS, ["--nproc", "4", "--parallel.pp=2", "--parallel.zero=1"])],
    "pp2_tp2_4": [(STEPS, ["--nproc", "4", "--parallel.pp=2", "--parallel.tp=2"])],
    # The three complete example loops (examples/), as `meshrun launch --nproc-per-node 2` runs
    # them, from the checkout given: the Hugging Face model under ZeRO-3, the others under DDP.
    "example_hf_causal_lm": [(STEPS, ["--example", "hf_causal_lm.py", "--parallel.zero=3"])],
    "example_nanogpt_style": [(STEPS, ["--example", "nanogpt_style.py"])],
    "example_cnn_classifier": [(STEPS, ["--example", "cnn_classifier.py"])],
}
# The manifest and its marker hold a creation time; DCP's .metadata differs between two runs of
# the same code (measured: the only file that did), so the tensors are compared loaded back.
SKIP = {"manifest.json", "COMPLETE", ".metadata"}


def run_layout(name: str, src: Path, work: Path, timeout: float) -> dict[str, Any]:
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(src.resolve()), "OMP_NUM_THREADS": "1"}
    for steps, overrides in LAYOUTS[name]:
        if overrides[:1] == ["--example"]:  # the checkout's own example script
            script = src.resolve().parent / "examples" / overrides[1]
            cmd = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", str(script)]
            cmd += [f"--optim.steps={steps}", f"--job.run_dir={run_dir}", *overrides[2:]]
            cmd += ["--metrics.progress=false", "--checkpoint.interval=3"]  # final parameters
        else:
            nproc = overrides[1] if overrides[:1] == ["--nproc"] else "2"
            overrides = overrides[2:] if overrides[:1] == ["--nproc"] else overrides
            cmd = [sys.executable, "-m", "meshrun", "demo", "--nproc", nproc]
            cmd += ["--steps", str(steps), "--run-dir", str(run_dir), *overrides, *COMMON]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise SystemExit(f"{name}: {' '.join(cmd)} exited {done.returncode}\n{done.stderr}")
    return {"metrics": _metrics(run_dir), **_checkpoints(run_dir / "checkpoints")}


def _metrics(run_dir: Path) -> dict[str, Any]:
    steps, evals = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "eval":  # the demo's own record, or run.evaluate's
            evals.append(
                [rec.get("at_step", rec.get("step")), rec.get("val_loss", rec.get("loss"))]
            )
        elif "loss" in rec and "step" in rec:
            steps.append([rec["step"], rec["loss"], rec.get("lr")])
    return {"steps": steps, "evals": evals}


def _checkpoints(root: Path) -> dict[str, Any]:
    files: dict[str, str] = {}
    states: dict[str, Any] = {}  # each state.json, to name what differs when its hash does
    dirs = sorted(p for p in root.glob("step_*") if p.is_dir())
    for d in dirs:
        for f in sorted(d.rglob("*")):
            if f.is_file() and f.name not in SKIP:
                files[str(f.relative_to(root))] = hashlib.sha256(f.read_bytes()).hexdigest()
        if (d / "state.json").is_file():
            states[d.name] = json.loads((d / "state.json").read_text())
    tensors = _tensor_digests(dirs[-1]) if dirs else {}
    return {"files": files, "tensors": tensors, "states": states}


def _tensor_digests(ckpt: Path) -> dict[str, str]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(ckpt), str(out))
        state = torch.load(out, weights_only=True)
    flat: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k in sorted(node, key=str):
                walk(f"{prefix}.{k}" if prefix else str(k), node[k])
        elif isinstance(node, torch.Tensor):
            t = node.detach().contiguous().cpu().reshape(-1)
            flat[prefix] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()

    walk("", state)
    return flat


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            out.append(f"{name}: only in {'the first' if name in a else 'the second'}")
            continue
        for key, what in (
            ("metrics", "losses"),
            ("files", "checkpoint files"),
            ("tensors", "tensors"),
        ):
            x, y = a[name][key], b[name][key]
            if x != y:
                diff = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
                out.append(f"{name}: {what} differ ({len(diff)} of {len(x)}: {diff[:4]})")
        out += _state_keys(name, a[name].get("states", {}), b[name].get("states", {}))
    return out


def _state_keys(name: str, x: dict[str, Any], y: dict[str, Any]) -> list[str]:
    """Which parts of each checkpoint's state.json differ (when both runs recorded them)."""
    out = []
    for step in sorted(set(x) & set(y)):
        keys = [k for k in sorted(set(x[step]) | set(y[step])) if x[step].get(k) != y[step].get(k)]
        plain = x[step].get("plain", {}), y[step].get("plain", {})
        keys += [
            f"plain.{k}"
            for k in sorted(set(plain[0]) | set(plain[1]))
            if plain[0].get(k) != plain[1].get(k)
        ]
        if keys:
            out.append(f"{name}: {step}/state.json: {', '.join(keys)} differ")
    return out


def summary(d: dict[str, Any]) -> str:
    lines = []
    for name, r in sorted(d.items()):
        steps = r["metrics"]["steps"]
        last = f"step {steps[-1][0]} loss {steps[-1][1]!r}" if steps else "no steps"
        lines.append(
            f"{name}: {len(steps)} logged steps, {last}; {len(r['files'])} checkpoint files, "
            f"{len(r['tensors'])} tensors"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the layouts from a source tree, write JSON")
    r.add_argument("--src", type=Path, default=Path("src"), help="the checkout's src/ folder")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "compare_runs")
    r.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    c = sub.add_parser("compare", help="compare two JSONs written by run")
    c.add_argument("first", type=Path)
    c.add_argument("second", type=Path)
    a = p.parse_args()
    if a.cmd == "run":
        result = {name: run_layout(name, a.src, a.work, a.timeout) for name in a.layouts}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1, sort_keys=True))
        print(summary(result))
        return 0
    first, second = json.loads(a.first.read_text()), json.loads(a.second.read_text())
    problems = compare(first, second)
    print(summary(first))
    for line in problems:
        print("DIFFERENT:", line)
    if not problems:
        print(f"identical: {len(first)} layouts, losses, checkpoint files and tensors bitwise")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
