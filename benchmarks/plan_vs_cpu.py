"""Predicted (``meshrun plan --calibration``) against measured model-state memory and step time
of the demo GPT ("small") on this machine: CPU, Gloo, N processes, under DDP, ZeRO-2, ZeRO-3
and TP 2.

1. ``meshrun bench all`` on N processes writes the calibration file (matmul FLOP/s, the demo
   GPT's achievable fraction, the all-reduce bus bandwidth).
2. Each layout trains the demo GPT for a few steps through ``meshrun launch`` (fp32, AdamW,
   micro-batch 8, no accumulation). Rank 0 records the model states: the parameters at their
   largest (right after forward: FSDP2's ZeRO-2 keeps them gathered until backward) + the
   gradients after backward + the optimizer states, in local bytes (DTensors: their shards),
   the most loaded rank's; and the median step time of the slowest rank.
3. The planner evaluates the same layout with the calibration and the table is printed.

    .venv/bin/python benchmarks/plan_vs_cpu.py [--nproc 2] [--steps 8] [--skip 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LAYOUTS = {
    "DDP": {"parallel.zero": "0"},
    "ZeRO-2": {"parallel.zero": "2"},
    "ZeRO-3": {"parallel.zero": "3"},
    "TP 2": {"parallel.tp": "2", "parallel.zero": "0"},
}
MICRO_BATCH = 8


def _local_bytes(t: Any) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return int(t.numel() * t.element_size())


def worker(out: str, steps: int, skip: int, overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist

    import meshrun
    from meshrun.demo.model import GPT, demo_config

    run = meshrun.init(argv=overrides)
    cfg = demo_config("small")
    model = run.parallelize(GPT(cfg))
    opt = run.optimizer(model, torch.optim.AdamW, lr=1e-4)
    g = torch.Generator().manual_seed(run.dp_rank)
    x = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len), generator=g)
    times, states = [], (0, 0, 0)
    for step in range(steps):
        dist.barrier()
        start = time.perf_counter()
        loss = model(x, x)
        params = sum(_local_bytes(p) for p in model.parameters())
        loss.backward()
        grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        opt.step()
        optim = sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.dim() > 0)  # fmt: skip
        opt.zero_grad(set_to_none=True)
        if step >= skip:
            times.append(time.perf_counter() - start)
        states = (params, grads, optim)
    local = torch.tensor([statistics.median(times), *states], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(run.world_size)]
    dist.all_gather(gathered, local)
    if run.is_main:
        worst = max(gathered, key=lambda t: float(t[1:].sum()))
        slowest = max(float(t[0]) for t in gathered)
        result = {"step_s": slowest, "params": float(worst[1]), "grads": float(worst[2]),
                  "optimizer": float(worst[3])}  # fmt: skip
        Path(out).write_text(json.dumps(result))


def predict(layout: dict[str, str], nproc: int, calibration: str) -> dict[str, float]:
    import torch

    from meshrun.demo.model import GPT, demo_config
    from meshrun.plan.cli import read_calibration
    from meshrun.plan.cost import Cluster, Layout, Model, Training, evaluate

    cfg = demo_config("small")
    with torch.device("meta"):
        meta = GPT(cfg)
    m = Model(layers=cfg.n_layer, hidden=cfg.d_model, heads=cfg.n_head, vocab=cfg.vocab_size,
              seq=cfg.seq_len, ffn=cfg.ffn_mult * cfg.d_model,
              params=sum(p.numel() for p in meta.parameters()),
              layer_params=sum(p.numel() for p in meta.blocks[0].parameters()))  # fmt: skip
    tp, zero = int(layout.get("parallel.tp", "1")), int(layout["parallel.zero"])
    dp = nproc // tp
    rates = read_calibration(calibration)
    c = Cluster(nodes=1, gpus_per_node=nproc, **rates)  # type: ignore[arg-type]
    lay = Layout(dp_shard=dp, tp=tp, zero=zero, micro_batch=MICRO_BATCH)
    e = evaluate(m, lay, Training(global_batch=MICRO_BATCH * dp, precision="fp32"), c)
    assert e.time is not None
    mem = e.memory
    return {"step_s": e.time.total, "params": mem.params, "grads": mem.grads,
            "optimizer": mem.optimizer}  # fmt: skip


def meshrun(*args: str, cwd: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MESHRUN_CONFIG"}
    proc = subprocess.run([sys.executable, "-m", "meshrun", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"meshrun {' '.join(args[:3])} failed:\n{proc.stdout[-3000:]}"
                         f"\n{proc.stderr[-3000:]}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    if a.worker:
        from meshrun.entry import main as entry

        entry(worker)(a.out, a.steps, a.skip, rest)
        return
    work = tempfile.mkdtemp(prefix="plan_vs_cpu_")
    cal = str(Path(work) / "cal.json")
    meshrun("bench", "all", "--nproc-per-node", str(a.nproc), "--out", cal, "--run-dir",
            str(Path(work) / "bench"), cwd=work)  # fmt: skip
    print(f"calibration ({a.nproc} processes): {json.loads(Path(cal).read_text())['cluster']}")
    print(f"{'layout':>8} {'pred MB':>8} {'meas MB':>8} {'err':>6} {'pred s':>8} {'meas s':>8} "
          f"{'err':>6}")  # fmt: skip
    for name, layout in LAYOUTS.items():
        tp = int(layout.get("parallel.tp", "1"))
        out = str(Path(work) / f"{name.replace(' ', '')}.json")
        sets = [f"--{k}={v}" for k, v in layout.items()]
        batch = [f"--data.micro_batch={MICRO_BATCH}",
                 f"--data.global_batch={MICRO_BATCH * a.nproc // tp}",
                 f"--job.run_dir={Path(work) / name.replace(' ', '')}",
                 "--metrics.progress=false"]  # fmt: skip
        meshrun("launch", "--nproc-per-node", str(a.nproc), __file__, "--worker", "--out", out,
                "--steps", str(a.steps), "--skip", str(a.skip), *sets, *batch, cwd=work)  # fmt: skip
        meas = json.loads(Path(out).read_text())
        pred = predict(layout, a.nproc, cal)
        pm = sum(pred[k] for k in ("params", "grads", "optimizer"))
        mm = sum(meas[k] for k in ("params", "grads", "optimizer"))
        print(f"{name:>8} {pm / 2**20:>8.2f} {mm / 2**20:>8.2f} {pm / mm - 1:>+6.1%} "
              f"{pred['step_s']:>8.3f} {meas['step_s']:>8.3f} "
              f"{pred['step_s'] / meas['step_s'] - 1:>+6.1%}")  # fmt: skip


if __name__ == "__main__":
    main()
