"""What DiLoCo costs in convergence on a small Hugging Face model: the exact validation loss
after the same tokens with DDP and with DiLoCo (H = 10, 50), on loopback.

    .venv/bin/python benchmarks/diloco_convergence.py [--steps 100] [--cases ddp,diloco10,diloco50]
        [--out diloco_convergence.json]

The model: a Llama built from a ``LlamaConfig`` (nothing downloaded; hidden 64, 2 layers, 4
heads, MLP 256, sequence 128, the demo's 257-id byte vocabulary: 0.17M parameters). The data:
the demo's token stream (``meshrun.demo``: the bytes of the local Python standard library,
4 MB, windows of 128, the tail held out), read through ``run.dataloader`` with the same seed,
so every case trains the same windows in the same order, and the demo's optimizer settings
(global batch 32 = micro-batch 8 x accumulation 2 x 2 processes; AdamW lr 2e-3, betas
(0.9, 0.95), weight decay 0.1, 10 warmup steps then cosine to 0.1). The cases, 2 processes
each (this machine has 2 cores):

- ``ddp``: ``meshrun launch --nproc-per-node 2``, one world, a gradient all-reduce per step;
- ``diloco10``, ``diloco50``: ``meshrun launch --nproc-per-node 2 --replica-groups 2`` (its own
  lighthouse; 2 groups of 1 process, each half of the global batch), with
  ``fault_tolerance.diloco_sync_every = H`` and the default outer optimizer (Nesterov SGD,
  lr 0.7, momentum 0.9), ``min_replicas = 2``: both groups in every outer step.

Printed: per case the exact validation loss before and after ``--steps`` inner steps (every
held-out window once, ``run.evaluate``) and the difference to DDP's. With ``--steps`` a
multiple of 50 the last step is an outer step for both H, so both groups end on the same
weights, and the benchmark checks that their losses are equal. No timing: only losses (there
is no throttled link here; docs/slow_links.md section 3 times the demo over one).

Run without arguments it starts the cases; ``meshrun launch`` runs the same file as the
worker (``--worker``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SEQ = 128  # the demo's "small" window
CORPUS_BYTES = 4_000_000  # the demo's default
DEMO_KEYS = [  # src/meshrun/demo/demo.toml, spelled out (this script is not the demo module)
    "--data.global_batch=32",
    "--data.micro_batch=8",
    "--optim.lr=2e-3",
    "--optim.warmup_steps=10",
    "--optim.decay=cosine",
    "--optim.min_lr_ratio=0.1",
    "--optim.weight_decay=0.1",
    "--metrics.progress=false",
]
CASES: dict[str, list[str]] = {
    "ddp": [],
    "diloco10": ["--replica-groups", "2"],
    "diloco50": ["--replica-groups", "2"],
}


# --- the worker (under meshrun launch) -----------------------------------------------------


def worker(rest: list[str]) -> None:
    import torch
    import torch.nn.functional as F
    from torch import Tensor, nn
    from transformers import AutoModelForCausalLM, LlamaConfig

    import meshrun
    from meshrun.demo.train import demo_datasets

    run = meshrun.init(argv=rest)
    train, val = demo_datasets(run, SEQ, CORPUS_BYTES)
    config = LlamaConfig(
        vocab_size=train.manifest.vocab_size,  # 256 bytes + end of document
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        attn_implementation="eager",
        dtype=torch.float32,
    )
    net = AutoModelForCausalLM.from_config(config)  # meshrun.init seeded torch: same weights
    params = sum(p.numel() for p in net.parameters())
    model = run.parallelize(net)
    opt = run.optimizer(
        model,
        torch.optim.AdamW,
        lr=run.scaled_lr(),
        betas=(0.9, 0.95),
        weight_decay=run.config.optim.weight_decay,
    )
    run.lr_scheduler(opt)

    def lm_loss(m: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        logits = m(input_ids=batch["input"]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["target"].flatten())

    start = run.evaluate(model, run.dataloader(val, mode="eval"), lm_loss)
    for batch in run.steps(run.dataloader(train)):
        run.backward(lm_loss(model, batch))
        run.optimizer_step(opt)
    end = run.evaluate(model, run.dataloader(val, mode="eval"), lm_loss)
    if run.is_main:
        out = {"params": params, "val_windows": len(val), "start": start, "end": end}
        (run.run_dir / "convergence.json").write_text(json.dumps(out))
    run.close()


# --- the cases -----------------------------------------------------------------------------


def run_case(name: str, run_dir: Path, steps: int, timeout: float) -> dict[str, Any]:
    """One case's launch; its val losses (per group for DiLoCo)."""
    more = [f"--fault_tolerance.diloco_sync_every={name.removeprefix('diloco')}"]
    more += ["--fault_tolerance.min_replicas=2"]
    cmd = [
        *(PY, "-m", "meshrun", "launch", "--nproc-per-node", "2", *CASES[name]),
        *(__file__, "--worker", f"--job.run_dir={run_dir}", f"--optim.steps={steps}"),
        *DEMO_KEYS,
        *(more if name.startswith("diloco") else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{name} exited {done.returncode}:\n{done.stderr[-3000:]}")
    dirs = [run_dir / "group0", run_dir / "group1"] if CASES[name] else [run_dir]
    results = [json.loads((d / "convergence.json").read_text()) for d in dirs]
    return {**results[0], "groups_end": [r["end"] for r in results]}


def report(results: dict[str, dict[str, Any]], steps: int) -> list[str]:
    first = next(iter(results.values()))
    lines = [
        f"Llama {first['params']:,} parameters; the demo's tokens: {steps} inner steps x 32 "
        f"windows of {SEQ}; exact val loss over {first['val_windows']} held-out windows",
        f"{'case':<10} {'val loss at 0':>13} {'after':>9} {'vs DDP':>8} {'vs DDP %':>9}",
    ]
    ddp = results.get("ddp", {}).get("end")
    for name, r in results.items():
        diff = pct = "-"
        if ddp is not None and name != "ddp":
            diff, pct = f"{r['end'] - ddp:+.4f}", f"{100 * (r['end'] - ddp) / ddp:+.1f} %"
        lines.append(f"{name:<10} {r['start']:>13.4f} {r['end']:>9.4f} {diff:>8} {pct:>9}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default="diloco_convergence.json")
    p.add_argument("--worker", action="store_true", help="(under meshrun launch)")
    a, rest = p.parse_known_args()
    if a.worker:
        import meshrun

        meshrun.main(worker)(rest)  # a failing rank's traceback reaches the launcher; exits
        return
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.cases.split(","):
            results[name] = r = run_case(name, Path(tmp) / name, a.steps, 1800)
            ends = r["groups_end"]
            print(f"{name}: val loss {r['start']:.6f} -> {r['end']:.6f} (per group {ends})")
            if a.steps % 50 == 0 and len(set(ends)) != 1:
                raise SystemExit(f"{name}: the groups end on different losses {ends}")
    print("\n".join(report(results, a.steps)))
    Path(a.out).write_text(json.dumps({"steps": a.steps, "cases": results}, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
