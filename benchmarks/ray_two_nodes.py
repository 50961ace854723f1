"""The demo across two Ray nodes, against ``meshrun launch``, and the time to the first step.

    sudo .venv/bin/python benchmarks/ray_two_nodes.py [--steps 8]

Three runs of the demo (tiny model, same seed, same global batch), 2 processes each:

1. ``meshrun launch --nproc-per-node 2`` (torchrun), the reference;
2. ``meshrun ray launch --workers 2`` with no ``--address``: a local Ray runtime started for
   the job and stopped after, inside a network namespace whose only interface is loopback;
3. ``meshrun ray launch --address HEAD --workers 2`` on a two-node Ray cluster: a head and a
   second ``ray start --address`` in two namespaces joined by veth (tests/netns.py), one CPU
   each, so one worker runs on each node and Gloo crosses the veth.

Printed per run: the time from the command's start to step 1 (the ``time`` of step 1 in
``metrics.jsonl``, a wall clock), the whole command's time, and whether every logged loss
equals the reference's bit for bit. The cluster's own start (``ray start``) is timed apart.
Every Ray process runs inside the namespaces and is killed with them (never ``ray stop``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import netns  # noqa: E402 (tests/netns.py: the namespaces the tests use)

RAY = str(Path(sys.executable).with_name("ray"))
DEMO = ["-m", "meshrun.demo", "--size", "tiny", "--corpus-bytes", "300000"]
DEMO += ["--metrics.progress=false", "--job.timeout_s=120"]


def base_env(tmp: Path, token: Path, veth: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    tmp.mkdir(parents=True, exist_ok=True)
    if veth:  # across the namespaces: Gloo on the veth, not loopback
        env["GLOO_SOCKET_IFNAME"] = netns.IFNAME
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "RAY_TMPDIR": str(tmp),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_USAGE_STATS_ENABLED": "0",
    }


def timed(argv: list[str], env: dict[str, str], log: Path) -> tuple[float, float]:
    """(start epoch, seconds) of one command; its output goes to ``log``."""
    start = time.time()
    with open(log, "w") as out:
        code = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"{argv[:8]} failed ({code}); see {log}")
    return start, time.time() - start


def losses(run_dir: Path) -> tuple[dict[int, float], list[tuple[int, float]], float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["step"], r["loss"]) for r in records if "step" in r and "loss" in r]
    first = next(r["time"] for r in records if r.get("step") == 1)
    return dict(steps), steps, first


def report(name: str, run_dir: Path, start: float, took: float, ref: dict[int, float]) -> None:
    _, steps, first = losses(run_dir)
    same = all(loss == ref[step] for step, loss in steps) and len(steps) == len(ref)
    print(
        f"{name:<44} first step {first - start:6.1f} s | total {took:6.1f} s | "
        f"losses bitwise equal to torchrun: {same}",
        flush=True,
    )


def local_runtime(work: Path, token: Path, steps: list[str], ref: dict[int, float]) -> None:
    name = f"mrray{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        run_dir = work / "ray-local"
        argv = ["ip", "netns", "exec", name, sys.executable, "-m", "meshrun", "ray", "launch"]
        argv += ["--workers", "2", *DEMO, *steps, f"--job.run_dir={run_dir}"]
        start, took = timed(argv, base_env(work / "tmp-local", token), work / "ray-local.log")
        report("meshrun ray launch (local runtime)", run_dir, start, took, ref)
    finally:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in pids.stdout.split():
            subprocess.run(["kill", "-9", pid])
        subprocess.run(["ip", "netns", "del", name])


def two_nodes(work: Path, token: Path, steps: list[str], ref: dict[int, float]) -> None:
    with netns.hosts(2) as net:
        head = f"{net.address(0)}:6379"
        start = [RAY, "start", "--num-cpus=1"]
        t0 = time.time()
        for i, extra in enumerate(
            [["--head", "--port=6379", "--include-dashboard=false"], [f"--address={head}"]]
        ):
            argv = net.argv(i, [*start, *extra, f"--node-ip-address={net.address(i)}"])
            timed(argv, base_env(work / f"tmp-node{i}", token, True), work / f"ray-start{i}.log")
        print(f"{'ray start: head + second node':<44} {time.time() - t0:6.1f} s", flush=True)
        run_dir = work / "ray-two-nodes"
        argv = [sys.executable, "-m", "meshrun", "ray", "launch", "--address", head]
        argv += ["--workers", "2", *DEMO, *steps, f"--job.run_dir={run_dir}"]
        env = base_env(work / "tmp-node0", token, True)
        start_s, took = timed(net.argv(0, argv), env, work / "ray-two-nodes.log")
        report("meshrun ray launch --address (two nodes)", run_dir, start_s, took, ref)
        hosts = {json.loads(p.read_text())["host"] for p in run_dir.glob("logs/ray/*/where.json")}
        print(f"{'workers ran on':<44} {', '.join(sorted(hosts))}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    a = p.parse_args()
    if reason := netns.available():
        raise SystemExit(reason)
    work = Path(tempfile.mkdtemp(prefix="mrray-bench-"))
    token = work / "token"
    token.write_text(secrets.token_hex(32))
    steps = [f"--optim.steps={a.steps}"]
    run_dir = work / "torchrun"
    argv = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", *DEMO, *steps]
    start, took = timed([*argv, f"--job.run_dir={run_dir}"], base_env(work, token), work / "t.log")
    ref, _, first = losses(run_dir)
    print(
        f"{'meshrun launch --nproc-per-node 2':<44} first step {first - start:6.1f} s | "
        f"total {took:6.1f} s",
        flush=True,
    )
    local_runtime(work, token, steps, ref)
    two_nodes(work, token, steps, ref)
    print(f"(logs and run directories under {work})")


if __name__ == "__main__":
    main()
