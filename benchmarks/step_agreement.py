"""What the one per-step agreement saves: meshrun's per-step "does any rank say yes?"
collectives before (three all-reduces: the numerics guard with the loss, the preemption flag,
the async-save poll while a save is in flight) against after (one ``StepAgreement.exchange``
carrying all of them), on 2 ranks, interleaved in one process pair, medians and ratios.

    .venv/bin/python benchmarks/step_agreement.py [--calls 25] [--steps 10] [--pairs 10]
        [--size tiny] [--out results.json]

Two measurements in one ``meshrun launch --nproc-per-node 2`` run:

``exchange``: the collectives on their own, ranks lined up by a barrier before each call (so no
rank waits for a slower one). A = one ``StepAgreement.exchange`` (the guard's loss, the
preemption and async-save flags from their providers); B = the three all-reduces meshrun ran
before, written as they were (a ``world + 2`` float64 SUM for the guard and loss, then two
one-int MAX all-reduces, each read back with ``.item()``). Blocks of ``--calls`` calls, A B A B
...; per block the median call time; per adjacent pair the ratio B/A; the median over pairs.

``steps``: a 2-rank DDP training run of the demo's GPT (``--size``) on random tokens, switching
every ``--steps`` optimizer steps between A (meshrun as it is: the agreement only;
``checkpoint.on_signal = false`` so no other flag collective runs whatever the checkpoint code)
and B (the same plus the two old one-int flag all-reduces after ``run.optimizer_step``, where
the checkpointer ran them: a step with an async save in flight paid both). The first step of a
block is dropped (it carries the switch); per block the median step time (end of one
``optimizer_step`` to the end of the next, all of it); ratio B/A per pair, median over pairs.
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

# --- worker ------------------------------------------------------------------------------


def old_three(device: Any, loss: float, rank: int, world: int) -> float:
    """The three per-step collectives as meshrun ran them before the agreement."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(world + 2, dtype=torch.float64)  # guard: [loss sum, ranks, bad per rank]
    buf[0], buf[1] = loss, 1.0
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    mean = float(buf[0]) / float(buf[1])
    for _ in range(2):  # the preemption flag, then the async-save poll
        flag = torch.tensor([0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        flag.item()
    return mean


def old_flags(device: Any) -> None:
    """The two flag all-reduces the checkpointer ran after each optimizer step."""
    import torch
    import torch.distributed as dist

    for _ in range(2):
        flag = torch.tensor([0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        flag.item()


def bench_exchange(a: argparse.Namespace, device: Any) -> list[dict[str, float]]:
    import torch.distributed as dist

    from meshrun.runtime.agreement import Slot, StepAgreement

    agreement = StepAgreement(device)
    agreement.provide(Slot.PREEMPT, lambda: False)
    agreement.provide(Slot.SAVE_WRITING, lambda: False)
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = []
    for p in range(a.pairs):
        times: dict[str, list[float]] = {"a": [], "b": []}
        for mode in ("a", "b"):
            for i in range(a.calls):
                dist.barrier()
                t0 = time.perf_counter()
                if mode == "a":
                    agreement.exchange(p * a.calls + i, loss=1.5)
                else:
                    old_three(device, 1.5, rank, world)
                times[mode].append(time.perf_counter() - t0)
        a_s, b_s = statistics.median(times["a"]), statistics.median(times["b"])
        pairs.append({"a_ms": a_s * 1e3, "b_ms": b_s * 1e3, "ratio": b_s / a_s})
    return pairs


def bench_steps(a: argparse.Namespace, run: Any) -> list[dict[str, float]]:
    import torch

    from meshrun.demo.model import GPT, demo_config

    cfg = demo_config(a.size)
    torch.manual_seed(0)
    model = run.parallelize(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4096, cfg.seq_len + 1), generator=g)
    data = [{"input": t[:-1], "target": t[1:]} for t in tokens]
    rows: list[tuple[int, float]] = []  # (step, step time)
    t_last = time.perf_counter()
    for batch in run.steps(run.dataloader(data)):
        run.backward(model(batch["input"], batch["target"]))
        if run.optimizer_step(opt):
            if (run.step - 1) // a.steps % 2 == 1:  # B blocks: what the checkpointer added
                old_flags(run.device)
            now = time.perf_counter()
            rows.append((run.step, now - t_last))
            t_last = now
    return block_pairs(rows, a.steps)


def block_pairs(rows: list[tuple[int, float]], steps: int) -> list[dict[str, float]]:
    blocks: dict[int, list[float]] = {}
    for step, dt in rows:
        if (step - 1) % steps:  # the block's first step carries the switch: dropped
            blocks.setdefault((step - 1) // steps, []).append(dt)
    pairs = []
    for k in range(0, max(blocks) + 1, 2):
        if k + 1 in blocks:
            a_s, b_s = statistics.median(blocks[k]), statistics.median(blocks[k + 1])
            pairs.append({"a_ms": a_s * 1e3, "b_ms": b_s * 1e3, "ratio": b_s / a_s})
    return pairs


def worker(a: argparse.Namespace) -> None:
    import meshrun

    argv = [
        f"--job.run_dir={a.run_dir}",
        f"--optim.steps={2 * a.steps * a.pairs}",
        "--metrics.progress=false",
        "--data.global_batch=16",
        "--data.micro_batch=8",
        "--checkpoint.on_signal=false",
        "--monitor.straggler_every=0",
    ]
    run = meshrun.init(argv=argv)
    result = {"exchange": bench_exchange(a, run.device), "steps": bench_steps(a, run)}
    result["exchanges"] = run._parts.monitor.agreement.exchanges
    if run.is_main:
        Path(a.run_dir, "result.json").write_text(json.dumps(result))
    run.close()


# --- driver ------------------------------------------------------------------------------


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in ("exchange", "steps"):
        pairs = result[part]
        out[part] = {
            "pairs": len(pairs),
            "after_ms": statistics.median(p["a_ms"] for p in pairs),
            "before_ms": statistics.median(p["b_ms"] for p in pairs),
            "before_over_after": statistics.median(p["ratio"] for p in pairs),
            "saved_ms": statistics.median(p["b_ms"] - p["a_ms"] for p in pairs),
            "ratio_range": [min(p["ratio"] for p in pairs), max(p["ratio"] for p in pairs)],
        }
    out["exchanges"] = result["exchanges"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=25, help="calls per exchange block")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per training block")
    p.add_argument("--pairs", type=int, default=10, help="A/B block pairs")
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--out", help="write the summary here (JSON)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "meshrun",
            "launch",
            "--nproc-per-node",
            "2",
            __file__,
            "--worker",
            f"--run-dir={tmp}",
            f"--calls={a.calls}",
            f"--steps={a.steps}",
            f"--pairs={a.pairs}",
            f"--size={a.size}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            sys.exit(f"benchmark run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
        summary = summarise(json.loads(Path(tmp, "result.json").read_text()))
    print(json.dumps(summary, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
