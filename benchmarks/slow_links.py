"""Training across a slow link: DDP across two hosts against DiLoCo (H = 10 and 50), measured
over a link throttled for real, next to the planner's prediction.

    sudo .venv/bin/python benchmarks/slow_links.py [--steps 100] [--size small] [--rate-mbit 100]
        [--cases bench,local,ddp,diloco10,diloco50] [--out slow_links.json]

Two network-namespace hosts (tests/netns.py) joined through a bridge by veths shaped with
``tc tbf`` to ``--rate-mbit`` (MTU 9000; this kernel has tbf, not netem: no delay is added).
One process per host (this machine has 2 cores), the demo GPT (``meshrun.demo``), the same
seed, global batch and tokens in every case:

- ``bench``: ``meshrun bench comm --nnodes 2`` across the hosts: the link's all-reduce rate;
- ``local``: the demo alone on each host at once (two one-process jobs, each with half the
  global batch: its share in the other cases), no communication: the compute per step the
  predictions start from, under the same CPU demand;
- ``ddp``: ``meshrun launch --nnodes 2``, one world over both hosts, a gradient all-reduce per
  step;
- ``diloco10``, ``diloco50``: one replica group per host (``fault_tolerance.replica_groups =
  2``, a lighthouse on host 0), ``fault_tolerance.diloco_sync_every = H``: an all-reduce of
  the pseudo-gradient every H steps. These need the DiLoCo keys in this tree's config: where
  ``meshrun config show`` does not know them, the case says so and is skipped.

Printed: wall time per 100 inner steps (the interval from step 1's end to the last step's, per
step, x 100), the final validation loss (the demo's exact pass over the held-out windows,
after the same tokens), the planner's predicted step time (plan/links.py:
compute + all_reduce(P x 4 bytes) / H over the bench's rate) and the measured and predicted
ratio to DDP. Every process runs inside the namespaces and is killed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import netns  # noqa: E402 (tests/netns.py: the namespaces the tests use)

PY = sys.executable
RDZV_PORT, LIGHTHOUSE_PORT = 29561, 29562
DILOCO_KEY = "fault_tolerance.diloco_sync_every"


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(var, None)  # meshrun picks the veth from the route to the endpoint
    env.setdefault("MESHRUN_JOB_SECRET", secrets.token_hex(32))  # the groups' shared secret
    return env


def run_on_hosts(net: netns.Hosts, argvs: dict[int, list[str]], timeout: float) -> list[str]:
    """Each host's command at once (the highest host first: the joiners wait for host 0);
    their outputs; a failure raises with its tail."""
    procs = {}
    env = _env()
    for i in sorted(argvs, reverse=True):
        procs[i] = subprocess.Popen(
            net.argv(i, argvs[i]),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
    outs = []
    for i, proc in sorted(procs.items()):
        out, _ = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"host {i} exited {proc.returncode}:\n{out[-3000:]}")
        outs.append(out)
    return outs


def demo(a: argparse.Namespace, run_dir: Path, *more: str) -> list[str]:
    return [
        *("-m", "meshrun.demo", "--size", a.size, "--steps", str(a.steps)),
        *(f"--job.run_dir={run_dir}", "--metrics.progress=false", "--job.timeout_s=600"),
        *more,
    ]


def launch(endpoint: str, nnodes: int, rank: int) -> list[str]:
    return [
        *(PY, "-m", "meshrun", "launch", "--nproc-per-node", "1", "--nnodes", str(nnodes)),
        *("--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--join-timeout", "180"),
    ]


def summary(run_dir: Path) -> dict[str, float]:
    """Wall time per 100 steps (step 1's end to the last step's) and the final val loss."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    evals = [r for r in rows if r.get("event") == "eval"]
    per_step = (steps[-1]["time"] - steps[0]["time"]) / (len(steps) - 1)
    return {"wall_per_100_s": 100 * per_step, "val_loss": evals[-1]["val_loss"]}


# --- the cases -----------------------------------------------------------------------------


def case_bench(net: netns.Hosts, tmp: Path) -> float:
    out = tmp / "calibration.json"
    argvs = {
        i: [
            *(PY, "-m", "meshrun", "bench", "comm", "--nproc-per-node", "1", "--nnodes", "2"),
            *("--node-rank", str(i), "--rdzv-endpoint", f"{net.address(0)}:{RDZV_PORT}"),
            *("--max-mb", "8", "--out", str(out), "--run-dir", str(tmp / "bench")),
        ]
        for i in (0, 1)
    }
    run_on_hosts(net, argvs, 300)
    return float(json.loads(out.read_text())["cluster"]["inter_bw"])


def case_local(net: netns.Hosts, tmp: Path, a: argparse.Namespace) -> dict[str, float]:
    """The demo alone on each host at once (two separate one-process jobs, each with one
    host's share of the batch): the compute per step under the same CPU demand as the cases
    across the link, where both hosts compute at once; host 0's figures."""
    argvs = {
        i: [
            *(PY, "-m", "meshrun", "launch", "--nproc-per-node", "1"),
            *demo(a, tmp / f"local{i}", "--data.global_batch=16"),  # one host's share of 32
        ]
        for i in (0, 1)
    }
    run_on_hosts(net, argvs, 1800)
    return summary(tmp / "local0")


def case_ddp(net: netns.Hosts, tmp: Path, a: argparse.Namespace) -> dict[str, float]:
    run_dir, endpoint = tmp / "ddp", f"{net.address(0)}:{RDZV_PORT}"
    argvs = {i: [*launch(endpoint, 2, i), *demo(a, run_dir)] for i in (0, 1)}
    run_on_hosts(net, argvs, 3600)
    return summary(run_dir)


def diloco_unknown() -> str | None:
    """Why this tree cannot run DiLoCo (its config refuses the key), or None."""
    done = subprocess.run(
        [PY, "-m", "meshrun", "config", "show", f"--{DILOCO_KEY}=10"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    if done.returncode == 0:
        return None
    first = (
        done.stderr.strip().splitlines()[0] if done.stderr.strip() else f"exit {done.returncode}"
    )
    return (
        f"this tree's config has no `{DILOCO_KEY}` (DiLoCo is not in it); "
        f"`meshrun config show` said: {first[:160]}"
    )


def case_diloco(net: netns.Hosts, tmp: Path, a: argparse.Namespace, h: int) -> dict[str, float]:
    """One replica group per host (each its own one-node launch on its own address), a
    lighthouse on host 0, DiLoCo every ``h`` steps; host 0's group's figures."""
    lighthouse = f"{net.address(0)}:{LIGHTHOUSE_PORT}"
    house = subprocess.Popen(
        net.argv(
            0, [PY, "-m", "meshrun", "lighthouse", "--bind", lighthouse, "--min-replicas", "2"]
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(),
        start_new_session=True,
    )
    try:
        argvs = {}
        for i in (0, 1):
            ft = [
                *("--fault_tolerance.replica_groups=2", f"--fault_tolerance.group_index={i}"),
                *(f"--fault_tolerance.lighthouse={lighthouse}", f"--{DILOCO_KEY}={h}"),
                "--fault_tolerance.min_replicas=2",
            ]
            endpoint = f"{net.address(i)}:{RDZV_PORT}"
            argvs[i] = [*launch(endpoint, 1, 0), *demo(a, tmp / f"diloco{h}" / f"group{i}", *ft)]
        run_on_hosts(net, argvs, 3600)
    finally:
        house.kill()
        house.wait()
    return summary(tmp / f"diloco{h}" / "group0")


# --- the prediction ------------------------------------------------------------------------


def demo_params(size: str) -> int:
    from meshrun.demo.model import GPT, demo_config

    return GPT(demo_config(size)).num_params()


def predicted_step_s(compute_s: float, params: int, bw: float, h: int) -> float:
    """The planner's step: compute + the all-reduce of P fp32 values over the 2-host link,
    every step (H = 1: DDP's gradients) or every H (DiLoCo's pseudo-gradient)."""
    from meshrun.plan.cost import Link
    from meshrun.plan.links import diloco_step_s, outer_step_s

    link = Link(size=2, bw=bw, latency=0.0, ag_bw=bw, rs_bw=bw)
    return diloco_step_s(compute_s, outer_step_s(link, params, "fp32"), h)


def report(results: dict[str, Any], a: argparse.Namespace) -> list[str]:
    params, bw = results["params"], results.get("link_bytes_s")
    lines = [
        f"demo {a.size}: {params:,} parameters; {a.steps} steps; link {a.rate_mbit} Mb/s tbf "
        + (f"(bench comm: {bw * 8 / 1e6:.1f} Mb/s)" if bw else "(not measured)"),
        f"{'case':<12} {'s/100 steps':>12} {'val loss':>9} {'predicted s/100':>16} "
        f"{'DDP / case':>11} {'predicted':>10}",
    ]
    local = results.get("local")
    ddp = results.get("ddp")
    for name, h in (("local", 0), ("ddp", 1), ("diloco10", 10), ("diloco50", 50)):
        r = results.get(name)
        if not isinstance(r, dict):
            if isinstance(r, str):
                lines.append(f"{name:<12} skipped: {r}")
            continue
        pred = ratio = pred_ratio = "-"
        if h and local and bw:
            c = local["wall_per_100_s"] / 100
            p_case = predicted_step_s(c, params, bw, h)
            pred = f"{100 * p_case:.1f}"
            pred_ratio = f"{predicted_step_s(c, params, bw, 1) / p_case:.2f}"
        if h and ddp:
            ratio = f"{ddp['wall_per_100_s'] / r['wall_per_100_s']:.2f}"
        lines.append(
            f"{name:<12} {r['wall_per_100_s']:>12.1f} {r['val_loss']:>9.4f} {pred:>16} "
            f"{ratio:>11} {pred_ratio:>10}"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--rate-mbit", type=int, default=100)
    p.add_argument("--cases", default="bench,local,ddp,diloco10,diloco50")
    p.add_argument("--out", default="slow_links.json")
    a = p.parse_args()
    cases = a.cases.split(",")
    results: dict[str, Any] = {"params": demo_params(a.size), "steps": a.steps, "size": a.size}
    why_not = diloco_unknown() if any(c.startswith("diloco") for c in cases) else None
    with tempfile.TemporaryDirectory() as tmp_text, netns.hosts(2) as net:
        tmp = Path(tmp_text)
        net.throttle(a.rate_mbit * 1_000_000, mtu=9000)
        for case in cases:
            load = Path("/proc/loadavg").read_text().split()[0]
            if case == "bench":
                results["link_bytes_s"] = case_bench(net, tmp)
            elif case in ("local", "ddp"):
                results[case] = (case_local if case == "local" else case_ddp)(net, tmp, a)
            elif case.startswith("diloco"):
                h = int(case.removeprefix("diloco"))
                results[case] = why_not or case_diloco(net, tmp, a, h)
            # Other work on the machine slows compute alone: the load beside each case.
            load += " -> " + Path("/proc/loadavg").read_text().split()[0]
            results.setdefault("load", {})[case] = load
            print(f"{case} (load {load}): {results.get(case, results.get('link_bytes_s'))}")
    print("\n".join(report(results, a)))
    print(f"load average (1 min) at each case's start -> end: {results.get('load')}")
    Path(a.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
