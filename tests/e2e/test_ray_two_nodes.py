"""One ``meshrun ray launch`` job across two Ray nodes: a head and a second ``ray start
--address`` in two network namespaces joined by veth (tests/netns.py), each node offering one
CPU, so Ray places one worker on each. The job trains (Gloo over the veth, the interface named
by ``GLOO_SOCKET_IFNAME``, which the launcher forwards) and rank 0 prints both hosts. The demo
across the two nodes, against ``meshrun launch``, is benchmarks/ray_two_nodes.py (heavier).

Ray here runs only inside the test's namespaces (never on the machine's own addresses) and is
removed with them: their pids are killed, never ``ray stop`` (it stops every Ray on the
machine)."""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from ray_nodes import start_ray

import netns

pytestmark = [pytest.mark.slow]
pytest.importorskip("ray.train.torch", reason="the `ray` extra (ray[train]) is not installed")

SCRIPTS = Path(__file__).parent / "scripts"
RAY = str(Path(sys.executable).with_name("ray"))


def node_env(root: Path, i: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    tmp = root / f"node{i}"  # one temp dir per node: both share this machine's filesystem
    tmp.mkdir(exist_ok=True)
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "RAY_TMPDIR": str(tmp),
        "RAY_AUTH_MODE": "token",  # this test's own token, not ~/.ray/auth_token
        "RAY_AUTH_TOKEN_PATH": str(root / "token"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "GLOO_SOCKET_IFNAME": netns.IFNAME,  # else Gloo falls back to loopback across nodes
    }


def kill_in(net: netns.Hosts, i: int) -> None:
    pids = subprocess.run(["ip", "netns", "pids", net.names[i]], capture_output=True, text=True)
    for pid in pids.stdout.split():
        subprocess.run(["kill", "-9", pid], capture_output=True)


def run_in(net: netns.Hosts, i: int, argv: list[str], env: dict[str, str], log: Path) -> str:
    with open(log, "w") as out:
        proc = subprocess.run(
            net.argv(i, argv),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=840,
            check=False,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


# heavy (CI's time): Ray across network namespaces is a heavy suite (benchmarks/ray_two_nodes.py);
# Ray on one node stays in CI in test_ray.py
@pytest.mark.heavy
@pytest.mark.timeout(1500)
def test_one_job_runs_across_two_ray_nodes(tmp_path: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="mrray-"))  # short: Ray's socket paths must fit 107 B
    (root / "token").write_text(secrets.token_hex(32))
    try:
        out = _two_node_job(root, tmp_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(out[-3000:])
    lines = [line for line in out.splitlines() if "ranks on hosts: " in line]
    assert lines, out[-4000:]
    hosts = lines[-1].split("ranks on hosts: ")[1].split(" ")[0].split(",")
    assert sorted(hosts) == ["node0", "node1"], lines
    assert "(gloo)" in lines[-1]


def _two_node_job(root: Path, tmp_path: Path) -> str:
    """Start the two nodes, run the job from the head's namespace; its output."""
    with netns.hosts(2) as net:
        head = f"{net.address(0)}:6379"
        start = [RAY, "start", "--num-cpus=1"]
        for i, extra in enumerate(
            [["--head", "--port=6379", "--include-dashboard=false"], [f"--address={head}"]]
        ):
            argv = net.argv(i, [*start, *extra, f"--node-ip-address={net.address(i)}"])
            clean = functools.partial(kill_in, net, i)
            start_ray(argv, node_env(root, i), tmp_path / f"node{i}.log", clean=clean)
        argv = [sys.executable, "-m", "meshrun", "ray", "launch", "--address", head]
        argv += ["--workers", "2", str(SCRIPTS / "ray_hosts.py"), "--optim.steps=2"]
        argv += [f"--job.run_dir={tmp_path / 'run'}", "--job.timeout_s=60"]
        return run_in(net, 0, argv, node_env(root, 0), tmp_path / "launch.log")
