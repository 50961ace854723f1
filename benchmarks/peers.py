"""meshrun's layouts against Hugging Face Accelerate, Lightning Fabric and DeepSpeed (issue 3).

```
python benchmarks/peers.py [--repeats 3] [--steps 14] [--skip 4] [--size small]
    [--frameworks meshrun,accelerate,fabric,deepspeed] [--zero 0,1,2,3] [--out results.json]
```

The peers are bench-only extras (``pip install -r benchmarks/requirements-peers.txt`` with
torch pinned, see benchmarks/README.md); one that is not installed in the interpreter running
this script is skipped with a line saying so. Each run trains the demo GPT for ``--steps``
steps on 2 Gloo ranks started by torchrun (``OMP_NUM_THREADS=1``, ``DS_ACCELERATOR=cpu``),
with the same initial weights, data, AdamW settings and clipping in every framework
(``benchmarks/peers/worker.py``). The layouts compared, by ZeRO stage:

| zero | meshrun | Accelerate | Fabric | DeepSpeed |
|---|---|---|---|---|
| 0 | DDP | DDP | ``ddp`` | stage 0 (its own data parallel) |
| 1 | ZeroRedundancyOptimizer | - | - | stage 1 |
| 2 | FSDP2, no reshard after forward | FSDP2 plugin | FSDPStrategy SHARD_GRAD_OP | stage 2 |
| 3 | FSDP2 | FSDP2 plugin | FSDPStrategy FULL_SHARD | stage 3 |

A peer that refuses a layout on CPU (or silently ignores it) is reported once and not tried
again. Rounds are interleaved (round 1 runs every variant once, round 2 again, in reverse
order, ...) so that a machine that gets busier hits every variant alike. Printed per variant:
the median over rounds of its step time (median of the timed steps; the slowest rank's) and of
its CPU time per step (the busiest rank's process, all threads: far steadier than wall time on
a loaded machine), each with the median over rounds of its ratio to meshrun's same layout *in
the same round*, peak RSS per rank
(``ru_maxrss``, max over ranks) and its ratio to meshrun's, and the largest difference of its
per-step losses from meshrun's (all variants train the same thing, so this is ~0). Every run
asserts world size 2 and identical parameters on both ranks after the steps.
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

WORKER = Path(__file__).resolve().parent / "peers" / "worker.py"
FRAMEWORKS = ("meshrun", "accelerate", "fabric", "deepspeed")
MODULES = {"meshrun": "meshrun", "accelerate": "accelerate", "fabric": "lightning_fabric"}
MODULES["deepspeed"] = "deepspeed"
NO_ZERO1 = ("accelerate", "fabric")  # ZeRO-1 only through DeepSpeed itself
NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
WORLD = 2

Key = tuple[int, str]  # (zero stage, framework)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--skip", type=int, default=4, help="warm-up steps left out of the times")
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--zero", default="0,1,2,3", help="ZeRO stages (0 = DDP) to compare")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--out", type=Path, help="all runs and the table as JSON")
    return p.parse_args()


def installed(frameworks: list[str]) -> list[str]:
    """The frameworks importable here; a line for each one that is not."""
    import importlib.util

    found = []
    for fw in frameworks:
        if fw not in MODULES:
            sys.exit(f"--frameworks: unknown {fw!r}; choose from {', '.join(FRAMEWORKS)}")
        if importlib.util.find_spec(MODULES[fw]) is None:
            print(
                f"skipped: {fw} is not installed in {sys.executable} "
                "(pip install -r benchmarks/requirements-peers.txt torch==2.13.0)"
            )
        else:
            found.append(fw)
    if "meshrun" not in found:
        sys.exit("meshrun itself must be importable: every ratio is against it")
    return found


def variants(frameworks: list[str], stages: list[int]) -> list[Key]:
    out = []
    for zero in stages:
        for fw in frameworks:
            if zero == 1 and fw in NO_ZERO1:
                continue
            out.append((zero, fw))
    return out


def run_once(key: Key, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One torchrun world; rank 0 writes every rank's row. Returns them merged."""
    zero, fw = key
    result, log = tmp / f"{fw}{zero}.jsonl", tmp / f"{fw}{zero}.log"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(WORLD), str(WORKER), "--framework", fw, "--zero", str(zero)]
    cmd += ["--size", args.size, "--steps", str(args.steps), "--skip", str(args.skip)]
    cmd += ["--global-batch", str(args.global_batch), "--world", str(WORLD)]
    cmd += ["--result", str(result)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    load = os.getloadavg()[0]
    with log.open("w") as f:
        proc = subprocess.run(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout
        )
    if proc.returncode != 0 or not result.exists():
        tail = "\n".join(log.read_text().splitlines()[-15:])
        return {"failed": f"exit {proc.returncode}; log tail:\n{tail}"}
    rows = [json.loads(line) for line in result.read_text().splitlines()]
    if "unavailable" in rows[0]:
        return {"unavailable": rows[0]["unavailable"]}
    return {
        "step_s": max(r["step_s"] for r in rows),  # the slowest rank's
        "cpu_s": max(r["cpu_s"] for r in rows),
        "rss": max(r["rss"] for r in rows),
        "rss_setup": max(r["rss_setup"] for r in rows),
        "losses": rows[0]["losses"],
        "wrapper": rows[0]["wrapper"],
        "threads": max(r["threads"] for r in rows),
        "load": load,
    }


Runs = dict[Key, dict[int, dict[str, Any]]]  # variant -> round -> its result


def run_rounds(keys: list[Key], args: argparse.Namespace) -> Runs:
    runs: Runs = {k: {} for k in keys}
    dropped: set[Key] = set()
    with tempfile.TemporaryDirectory(prefix="meshrun-peers-") as tmp:
        for rnd in range(args.repeats):
            order = keys if rnd % 2 == 0 else keys[::-1]  # A B ... then ... B A
            for key in order:
                if key in dropped:
                    continue
                r = run_once(key, args, Path(tmp))
                if "failed" in r:  # e.g. Gloo's connect refused on a loaded machine: once more
                    print(f"retrying {key[1]} {NAMES[key[0]]} after: {r['failed']}", flush=True)
                    r = run_once(key, args, Path(tmp))
                label = f"round {rnd + 1} {NAMES[key[0]]:6} {key[1]:10}"
                if "step_s" in r:
                    runs[key][rnd] = r
                    print(
                        f"{label} {r['step_s']:.4f} s/step (CPU {r['cpu_s']:.4f})  peak RSS {r['rss'] / 2**20:.0f} MiB"
                        f"  ({r['wrapper']}, {r['threads']} thread(s), load {r['load']:.1f})",
                        flush=True,
                    )
                    continue
                if "unavailable" in r:
                    dropped.add(key)  # not tried again in later rounds
                print(f"{label} {'NOT AVAILABLE' if 'unavailable' in r else 'FAILED'}: ", end="")
                print(r.get("unavailable") or r["failed"], flush=True)
    return runs


def round_ratios(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], field: str) -> float:
    """Median over rounds of a/b, each ratio taken within one round (interleaved)."""
    return statistics.median(a[i][field] / b[i][field] for i in a.keys() & b.keys())


def table(runs: Runs) -> list[dict[str, Any]]:
    rows = []
    for (zero, fw), by_round in runs.items():
        base = runs.get((zero, "meshrun"), {})
        if not by_round.keys() & base.keys():
            continue
        rs, ref = list(by_round.values()), next(iter(base.values()))["losses"]
        loss_diff = max(abs(a - b) for r in rs for a, b in zip(r["losses"], ref, strict=True))
        rows.append(
            {
                "layout": NAMES[zero],
                "framework": fw,
                "rounds": len(rs),
                "step_s": statistics.median(r["step_s"] for r in rs),
                "time_ratio": round_ratios(by_round, base, "step_s"),
                "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                "cpu_ratio": round_ratios(by_round, base, "cpu_s"),
                "rss_mib": statistics.median(r["rss"] for r in rs) / 2**20,
                "rss_ratio": round_ratios(by_round, base, "rss"),
                "rss_setup_mib": statistics.median(r["rss_setup"] for r in rs) / 2**20,
                "loss_diff": loss_diff,
                "final_loss": rs[0]["losses"][-1],
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| layout | framework | rounds | step (s, median) | vs meshrun | CPU s/step | vs meshrun "
        "| peak RSS / rank (MiB) | vs meshrun | RSS before setup (MiB) | max loss diff vs meshrun |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layout']} | {r['framework']} | {r['rounds']} | {r['step_s']:.4f} "
            f"| {r['time_ratio']:.2f}x | {r['cpu_s']:.4f} | {r['cpu_ratio']:.2f}x "
            f"| {r['rss_mib']:.0f} | {r['rss_ratio']:.2f}x "
            f"| {r['rss_setup_mib']:.0f} | {r['loss_diff']:.1e} |"
        )


def targets(runs: Runs, rows: list[dict[str, Any]]) -> None:
    """The issue's three targets, each printed as met or not, with its figure."""

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT MET"

    print()
    ddp = runs.get((0, "meshrun"), {})
    if ddp and runs.get((3, "meshrun")):
        r = round_ratios(runs[(3, "meshrun")], ddp, "step_s")
        c = round_ratios(runs[(3, "meshrun")], ddp, "cpu_s")
        print(
            f"target meshrun ZeRO-3 step <= 1.10x its DDP: {r:.2f}x, {verdict(r <= 1.10)} "
            f"(CPU time {c:.2f}x)"
        )
    for zero in (1, 2):
        if ddp and runs.get((zero, "meshrun")):
            r = round_ratios(runs[(zero, "meshrun")], ddp, "rss")
            print(
                f"target meshrun ZeRO-{zero} peak RSS <= its DDP's: {r:.3f}x, {verdict(r <= 1.0)}"
            )
    for row in rows:
        if row["framework"] != "meshrun":
            ok = row["time_ratio"] >= 1.0  # the peer takes at least as long as meshrun
            print(
                f"target meshrun {row['layout']} no slower than {row['framework']}: "
                f"peer/meshrun {row['time_ratio']:.2f}x, {verdict(ok)} "
                f"(CPU time {row['cpu_ratio']:.2f}x)"
            )


def main() -> None:
    args = parse_args()
    frameworks = installed([f for f in args.frameworks.split(",") if f])
    keys = variants(frameworks, [int(z) for z in args.zero.split(",")])
    t0 = time.time()
    print(
        f"peers | demo GPT {args.size} | {WORLD} ranks, gloo, OMP_NUM_THREADS=1 | "
        f"{args.steps} steps ({args.skip} warm-up) | global batch {args.global_batch} | "
        f"{args.repeats} interleaved rounds | {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    runs = run_rounds(keys, args)
    rows = table(runs)
    print_table(rows)
    targets(runs, rows)
    print(f"\n{time.time() - t0:.0f} s in all")
    if args.out:
        out = {"rows": rows, "runs": {f"{z}/{fw}": rs for (z, fw), rs in runs.items()}}
        # JSON keys: "zero/framework" -> round -> result
        args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
