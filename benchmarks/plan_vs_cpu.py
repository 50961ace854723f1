"""Predicted (the planner with a ``meshrun bench`` calibration) against measured model-state
memory and step time of the demo GPT ("small", 3.3M parameters) on this machine: CPU, Gloo, N
processes, under DDP, ZeRO-2, ZeRO-3 and TP 2 (on 4 ranks: TP 2 x ZeRO-3 over dp 2, since DDP
cannot take tensor-parallel parameters).

The machine is shared and its load moves from second to second, so calibration and measurement
are interleaved: each round is one world started by ``meshrun launch`` that

1. calibrates the links with ``meshrun bench``'s own functions (the all-reduce/all-gather/
   reduce-scatter sweep fitted to the alpha-beta model, ``bench_tp``: DTensor's dispatch
   per tensor-parallel linear layer, and ``bench_fsdp``: FSDP2's cost per unit collective);
2. builds every layout (fp32, AdamW, micro-batch 8, no accumulation) and runs them interleaved:
   each cycle one step of every layout (order rotated per cycle) and, after the warm-up cycles,
   ``bench_compute`` (matmul and the demo GPT's FLOP/s, AdamW's step, a copy) between cycles,
   whose medians go into the calibration file, written exactly as ``meshrun bench all`` does;
3. records the model states (parameters at their largest, right after forward; gradients
   after backward; optimizer states; local bytes of DTensors, the most loaded rank's) and the
   median step time of the slowest rank.

The parent then evaluates each layout with ``meshrun plan``'s cost model and reader
(``read_calibration``) on that round's file, and prints per round and the median over rounds;
"before" is the same calibration without ``fsdp_unit_overhead`` (session 3's model). The
temporary folder (configs, calibration files, logs) is removed at the end.

    .venv/bin/python benchmarks/plan_vs_cpu.py [--nproc 2] [--rounds 5] [--steps 8] [--skip 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MICRO_BATCH = 8
# name -> (zero, tp) on 2 ranks; on 4 ranks "TP 2" runs tp 2 x dp 2 as FSDP2 ZeRO-3.
LAYOUTS = {"DDP": (0, 1), "ZeRO-2": (2, 1), "ZeRO-3": (3, 1), "TP 2": (0, 2)}


def _zero(name: str, nproc: int) -> int:
    zero, tp = LAYOUTS[name]
    return 3 if tp > 1 and nproc // tp > 1 else zero


def _local_bytes(t: Any) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return int(t.numel() * t.element_size())


# --- the workers (one world per round) -----------------------------------------------------


def worker(
    out: str, cal: str, steps: int, skip: int, seconds: float, order: list[str], argv: list[str]
) -> None:
    import torch.distributed as dist

    import meshrun
    from meshrun.diagnose.bench_comm import bench_comm
    from meshrun.diagnose.bench_compute import (
        bench_compute,
        bench_fsdp,
        bench_tp,
        slowest_rank_rates,
    )
    from meshrun.diagnose.calibration import write_calibration

    run = meshrun.init(argv=argv)
    comm = bench_comm(run.device, 16 * 2**20, seconds)
    tp = bench_tp(run.device, seconds)
    fsdp = bench_fsdp(run.device, seconds)
    built = {name: _build(run, name) for name in order}
    times: dict[str, list[float]] = {name: [] for name in order}
    states: dict[str, tuple[int, int, int]] = {}
    computes = []
    for step in range(steps):
        # Interleaved: one step of every layout per cycle (order rotated) and, once warm, the
        # compute calibration between cycles, so that the load of a shared machine, which
        # moves from second to second, falls on the calibration and on every layout alike.
        if step >= skip:
            rates = bench_compute(run.device, "fp32", seconds)
            computes.append(slowest_rank_rates(rates, run.device))
        for name in order[step % len(order) :] + order[: step % len(order)]:
            took, states[name] = _step(*built[name])
            if step >= skip:
                times[name].append(took)
    compute = {k: statistics.median(c[k] for c in computes) for k in computes[0]}
    if run.is_main:
        results = {"compute": compute, "comm": comm, "tp": tp, "fsdp": fsdp}
        write_calibration(cal, results, run.world_size, run.device)
    measured = {name: _summary(times[name], states[name]) for name in order}
    if run.is_main:
        import torch

        doc = {"measured": measured, "load": os.getloadavg(), "threads": torch.get_num_threads()}
        Path(out).write_text(json.dumps(doc))
    del built
    gc.collect()
    dist.barrier()


def _build(run: Any, name: str) -> tuple[Any, Any, Any]:
    import torch
    import torch.distributed as dist

    from meshrun.demo.model import GPT, demo_config
    from meshrun.parallel import parallelize
    from meshrun.runtime.mesh import ParallelDims, build_mesh

    zero, tp = LAYOUTS[name]
    zero = _zero(name, run.world_size)
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=run.world_size // tp, tp=tp)
    pcfg = dataclasses.replace(run.config.parallel, zero=zero, tp=tp, dp_shard=dims.dp_shard)
    cfg = demo_config("small")
    torch.manual_seed(0)
    model = parallelize(GPT(cfg), build_mesh(dims, "cpu"), pcfg, run.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank() // tp)  # one batch per tp group
    x = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len), generator=g)
    return model, opt, x


def _step(model: Any, opt: Any, x: Any) -> tuple[float, tuple[int, int, int]]:
    """One training step: its seconds and the model states (params at their largest, right
    after forward; gradients; optimizer states), local bytes."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss = model(x, x)
    params = sum(_local_bytes(p) for p in model.parameters())
    loss.backward()
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    opt.step()
    optim = sum(
        _local_bytes(v)
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, (params, grads, optim)


def _summary(times: list[float], states: tuple[int, int, int]) -> dict[str, float]:
    """The slowest rank's median step time; the most loaded rank's model states."""
    import torch
    import torch.distributed as dist

    local = torch.tensor([statistics.median(times), *states], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    worst = max(gathered, key=lambda t: float(t[1:].sum()))
    return {
        "step_s": max(float(t[0]) for t in gathered),
        "params": float(worst[1]),
        "grads": float(worst[2]),
        "optimizer": float(worst[3]),
    }


# --- the parent ----------------------------------------------------------------------------


def predict(name: str, nproc: int, calibration: str) -> dict[str, Any]:
    import torch

    from meshrun.cli.plan import read_calibration
    from meshrun.demo.model import GPT, demo_config
    from meshrun.plan.cost import Cluster, Layout, Model, Training, evaluate

    cfg = demo_config("small")
    with torch.device("meta"):
        meta = GPT(cfg)
    m = Model(
        layers=cfg.n_layer,
        hidden=cfg.d_model,
        heads=cfg.n_head,
        vocab=cfg.vocab_size,
        seq=cfg.seq_len,
        ffn=cfg.ffn_mult * cfg.d_model,
        params=sum(p.numel() for p in meta.parameters()),
        layer_params=sum(p.numel() for p in meta.blocks[0].parameters()),
        separate_qkv=True,
    )
    tp = LAYOUTS[name][1]
    dp = nproc // tp
    rates = read_calibration(calibration)
    c = Cluster(nodes=1, gpus_per_node=nproc, **rates)
    lay = Layout(dp_shard=dp, tp=tp, zero=_zero(name, nproc), micro_batch=MICRO_BATCH)
    t = Training(global_batch=MICRO_BATCH * dp, precision="fp32", sequence_parallel=False)
    e = evaluate(m, lay, t, c)
    # Session 3's model, for comparison: no FSDP2 per-unit term.
    before = evaluate(m, lay, t, dataclasses.replace(c, fsdp_unit_overhead=0.0)).time
    assert e.time is not None and before is not None
    mem = e.memory
    return {
        "step_s": e.time.total,
        "params": mem.params,
        "grads": mem.grads,
        "optimizer": mem.optimizer,
        "time": dataclasses.asdict(e.time),
        "step_s_before": before.total,
    }


def meshrun(*args: str, cwd: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MESHRUN_CONFIG"}
    proc = subprocess.run(
        [sys.executable, "-m", "meshrun", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode:
        raise SystemExit(
            f"meshrun {' '.join(args[:3])} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )


def _states(d: dict[str, Any]) -> float:
    return float(sum(d[k] for k in ("params", "grads", "optimizer")))


def run_round(a: argparse.Namespace, work: str, r: int) -> dict[str, Any]:
    names = list(LAYOUTS)
    order = names[r % len(names) :] + names[: r % len(names)]  # rotated: A B C D, B C D A, ...
    cal, out = str(Path(work) / f"cal{r}.json"), str(Path(work) / f"round{r}.json")
    batch = [
        f"--data.micro_batch={MICRO_BATCH}",
        f"--data.global_batch={MICRO_BATCH * a.nproc}",
        f"--job.run_dir={Path(work) / f'round{r}'}",
        "--metrics.progress=false",
    ]
    meshrun(
        "launch",
        "--nproc-per-node",
        str(a.nproc),
        __file__,
        "--worker",
        "--out",
        out,
        "--cal",
        cal,
        "--steps",
        str(a.steps),
        "--skip",
        str(a.skip),
        "--seconds",
        str(a.seconds),
        "--order",
        ",".join(order),
        *batch,
        cwd=work,
    )
    doc = json.loads(Path(out).read_text())
    rows = {}
    for name in names:
        pred, meas = predict(name, a.nproc, cal), doc["measured"][name]
        rows[name] = {
            "pred": pred,
            "meas": meas,
            "mem_err": _states(pred) / _states(meas) - 1,
            "time_err": pred["step_s"] / meas["step_s"] - 1,
            "time_err_before": pred["step_s_before"] / meas["step_s"] - 1,
        }
    rates = json.loads(Path(cal).read_text())["cluster"]
    return {
        "order": order,
        "load": doc["load"],
        "threads": doc["threads"],
        "cluster": rates,
        "rows": rows,
    }


def report(rounds: list[dict[str, Any]], nproc: int) -> dict[str, Any]:
    print(
        f"\n{nproc} ranks, {len(rounds)} rounds; load average at the end of each round: "
        + ", ".join(f"{r['load'][0]:.1f}" for r in rounds)
    )
    print(
        f"{'layout':>8} {'pred MB':>8} {'meas MB':>8} {'err':>6} | {'pred s':>7} {'meas s':>7}"
        f" {'med err':>8} {'before':>7} | per-round step-time error"
    )
    summary = {}
    for name in LAYOUTS:
        rows = [r["rows"][name] for r in rounds]
        pm, mm = _states(rows[0]["pred"]), _states(rows[0]["meas"])
        ps = statistics.median(r["pred"]["step_s"] for r in rows)
        ms = statistics.median(r["meas"]["step_s"] for r in rows)
        errs = [r["time_err"] for r in rows]
        med = statistics.median(errs)
        before = statistics.median(r["time_err_before"] for r in rows)
        summary[name] = {
            "pred_mb": pm / 2**20,
            "meas_mb": mm / 2**20,
            "mem_err": pm / mm - 1,
            "pred_s": ps,
            "meas_s": ms,
            "median_time_err": med,
            "time_errs": errs,
            "median_time_err_before": before,
        }
        print(
            f"{name:>8} {pm / 2**20:>8.2f} {mm / 2**20:>8.2f} {pm / mm - 1:>+6.1%} | "
            f"{ps:>7.3f} {ms:>7.3f} {med:>+8.1%} {before:>+7.1%} | "
            + " ".join(f"{e:+.0%}" for e in errs)
        )
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.2, help="per calibration measurement")
    p.add_argument("--json-out", help="write every round's figures here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--cal", help=argparse.SUPPRESS)
    p.add_argument("--order", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    if a.worker:
        from meshrun.train.entry import main as entry

        order = a.order.split(",")
        entry(worker)(a.out, a.cal, a.steps, a.skip, a.seconds, order, rest)
        return
    del rest
    rounds = []
    with tempfile.TemporaryDirectory(prefix="plan_vs_cpu_") as work:
        for r in range(a.rounds):
            rounds.append(run_round(a, work, r))
            row = rounds[-1]["rows"]
            print(
                f"round {r + 1}: "
                + ", ".join(
                    f"{n} {row[n]['pred']['step_s']:.3f}/{row[n]['meas']['step_s']:.3f} s"
                    for n in LAYOUTS
                ),
                flush=True,
            )
    summary = report(rounds, a.nproc)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"rounds": rounds, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
