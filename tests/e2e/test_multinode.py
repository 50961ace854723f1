"""``meshrun launch`` across hosts: Linux network namespaces as the hosts (tests/netns.py), one
real ``meshrun launch`` (torchrun agent, c10d rendezvous, Gloo) per namespace.

Each namespace has only loopback and a veth ``eth-mr`` with a private address, so a job that
picked loopback, advertised the wrong address or hosted no store would hang or fail here.
Needs root (skips otherwise); every process runs in its own session and is killed, and every
namespace deleted, also when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

import netns
from meshrun.launch.agent.watch import EXIT_AFTER_S, RDZV_GRACE_S

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).parent / "scripts"
PORT = 29531


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100"}
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(var, None)  # the test is about meshrun choosing them
    return env


@contextmanager
def nodes(n: int) -> Iterator[Cluster]:
    with netns.hosts(n) as net:
        cluster = Cluster(net)
        try:
            yield cluster
        finally:
            cluster.kill_all()


class Cluster:
    """Runs ``meshrun launch`` on namespace hosts and collects each one's output."""

    def __init__(self, net: netns.Hosts) -> None:
        self.net = net
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.endpoint = f"{net.address(0)}:{PORT}"

    def start(self, i: int, *args: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-m", "meshrun", "launch", *args]
        proc = subprocess.Popen(
            self.net.argv(i, argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
            start_new_session=True,  # its own process group: the test can kill the whole node
        )
        self.procs[i] = proc
        return proc

    def wait(self, i: int, timeout: float) -> tuple[int, str]:
        out, _ = self.procs[i].communicate(timeout=timeout)
        return self.procs[i].returncode, out

    def kill_node(self, i: int) -> None:
        """SIGKILL everything running in host i: its meshrun launch, agent and workers (the
        agent starts each worker in a session of its own, so a process group is not enough)."""
        found = subprocess.run(
            ["ip", "netns", "pids", self.net.names[i]], capture_output=True, text=True
        ).stdout.split()
        for pid in [self.procs[i].pid, *map(int, found)]:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def kill_all(self) -> None:
        for i, proc in self.procs.items():
            if proc.poll() is None:
                self.kill_node(i)
            proc.communicate()


def _launch_args(endpoint: str, nnodes: str, rank: int, *extra: str, nproc: int = 1) -> list[str]:
    return [
        *("--nnodes", nnodes, "--node-rank", str(rank), "--rdzv-endpoint", endpoint),
        *("--nproc-per-node", str(nproc), *extra),
    ]


def _steps(run_dir: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" not in r]


# --- a real two-host run -------------------------------------------------------------------


# heavy: test_trust_rendezvous.py::test_two_hosts_with_one_secret_train_... shows two hosts
# training like one (one process per host there; two per host here, against one host of four).
@pytest.mark.heavy
@pytest.mark.timeout(200)
def test_two_hosts_of_two_processes_train_like_one_host_of_four(tmp_path: Path) -> None:
    demo = ["-m", "meshrun.demo", "--steps", "6", "--size", "tiny"]
    multi, single = tmp_path / "multi", tmp_path / "single"
    with nodes(2) as cluster:
        for i in (1, 0):  # the non-host first: it waits for the store, then joins
            args = _launch_args(cluster.endpoint, "2", i, "--join-timeout", "90", nproc=2)
            cluster.start(i, *args, *demo, f"--job.run_dir={multi}")
        outs = [cluster.wait(i, 150) for i in (0, 1)]
    for rc, out in outs:
        assert rc == 0, out[-4000:]
    host_out, other_out = outs[0][1], outs[1][1]
    addr0, addr1 = cluster.net.address(0), cluster.net.address(1)
    # The veth, never loopback, with the route to the endpoint, on both nodes.
    assert f"interface eth-mr ({addr0}/24), route to {addr0}, this node hosts" in host_out
    assert f"interface eth-mr ({addr1}/24), route to {addr0}, this node joins" in other_out
    assert "interface lo" not in host_out + other_out
    assert "4 process(es) [torchelastic]" in host_out  # one world over both hosts
    assert "2 nodes joined [node0, node1]; versions and config agree" in other_out

    ref = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshrun",
            "launch",
            "--nproc-per-node",
            "4",
            *demo,
            f"--job.run_dir={single}",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    rows_multi, rows_single = _steps(multi), _steps(single)
    assert [r["step"] for r in rows_multi] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(rows_multi, rows_single, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a, b)


# --- failures: each fast, with the message that says what to fix ---------------------------


# Start-up allowance on top of a configured timeout: torch's imports and the agent's start on
# a loaded 2-core machine. A bound derived from the configuration, never a timing window: a
# launch that waited out its join timeout says "gave up", which the checks below refuse.
STARTUP_S = 60


def _stopped(cluster: Cluster, i: int, join_timeout_s: float = 0) -> str:
    """Node i's output once it stopped, which must be with an error and within its join
    timeout plus start-up (else the wait raises: a hang is a failure, never a pass)."""
    rc, out = cluster.wait(i, join_timeout_s + STARTUP_S)
    assert rc != 0, out[-2000:]
    return out


def _run_arg(tmp_path: Path) -> str:
    return f"--job.run_dir={tmp_path / 'r'}"


SCRIPT = str(SCRIPTS / "plain_ddp_ok.py")


def test_an_interface_that_does_not_exist_is_named_with_the_real_ones(tmp_path: Path) -> None:
    with nodes(2) as cluster:
        args = _launch_args(cluster.endpoint, "2", 1, "--interface", "eth9")
        cluster.start(1, *args, SCRIPT, _run_arg(tmp_path))
        out = _stopped(cluster, 1)
    assert "--interface 'eth9' does not exist" in out and "eth-mr" in out and "lo" in out


# heavy (CI's time): an unreachable rendezvous host stays in CI
# (test_a_node_alone_names_who_is_missing_..., test_doctor.py's unreachable master)
@pytest.mark.heavy
def test_an_endpoint_nobody_answers_is_named_after_the_join_timeout(tmp_path: Path) -> None:
    with nodes(2) as cluster:
        cluster.net.unplug(0)  # the endpoint's own host, off the network
        args = _launch_args(cluster.endpoint, "2", 1, "--join-timeout", "6")
        cluster.start(1, *args, SCRIPT, _run_arg(tmp_path))
        out = _stopped(cluster, 1, 6)
    assert f"the rendezvous endpoint {cluster.endpoint} could not be reached within 6 s" in out
    assert "--rdzv-endpoint is the address of one of the nodes" in out


# heavy (CI's time): the handshake's refusals stay in CI
# (test_two_nodes_with_different_configs_both_stop_naming_the_key)
@pytest.mark.heavy
def test_two_nodes_claiming_one_rank_both_stop_naming_both_hosts(tmp_path: Path) -> None:
    with nodes(2) as cluster:
        for i in (0, 1):
            args = _launch_args(cluster.endpoint, "2", 0, "--join-timeout", "40")
            cluster.start(i, *args, SCRIPT, _run_arg(tmp_path))
        outs = [_stopped(cluster, i, 40) for i in (0, 1)]
    for out in outs:
        assert "node_rank 0 is claimed by 2 nodes" in out and "gave up" not in out, out[-2000:]
        assert "node0 (node_rank 0)" in out and "node1 (node_rank 0)" in out


def test_two_nodes_with_different_configs_both_stop_naming_the_key(tmp_path: Path) -> None:
    with nodes(2) as cluster:
        for i in (0, 1):
            args = _launch_args(cluster.endpoint, "2", i, "--join-timeout", "40")
            cluster.start(i, *args, SCRIPT, _run_arg(tmp_path), f"--optim.lr={0.1 * (i + 1)}")
        outs = [_stopped(cluster, i, 40) for i in (0, 1)]
    for out in outs:
        assert "configs (digest of the resolved config" in out and "differ" in out
        assert "optim.lr: 0.1 on node0, 0.2 on node1" in out and "gave up" not in out
        assert "node0 (node_rank 0)" in out and "node1 (node_rank 1)" in out


def test_a_node_alone_names_who_is_missing_and_gives_up_at_its_join_timeout(
    tmp_path: Path,
) -> None:
    with nodes(2) as cluster:
        args = _launch_args(cluster.endpoint, "2", 0, "--join-timeout", "4")
        cluster.start(0, *args, SCRIPT, _run_arg(tmp_path))
        out = _stopped(cluster, 0, 4)
    assert "1/2 nodes joined [node0]; waiting for node_rank 1" in out
    assert "gave up after 4 s" in out


# --- elastic: a node goes away, the job goes on --------------------------------------------


@pytest.mark.timeout(240)
def test_elastic_job_continues_on_two_nodes_after_one_is_killed(tmp_path: Path) -> None:
    script = str(SCRIPTS / "slow_resumable.py")
    run_dir = tmp_path / "elastic"
    train = [
        script,
        f"--job.run_dir={run_dir}",
        "--optim.steps=24",
        "--checkpoint.interval=3",
        "--data.global_batch=24",
        "--data.micro_batch=4",
    ]
    with nodes(3) as cluster:
        for i in (0, 1, 2):
            args = _launch_args(cluster.endpoint, "2:3", 0, "--max-restarts", "2")
            # After the kill the agents wait this long for a third node (torch's default: 30 s).
            args += ["--rdzv-conf", "last_call_timeout=8"]
            cluster.start(i, *args, "--join-timeout", "90", *train)
        _wait_for_step(run_dir, 7, cluster, timeout=120)
        cluster.kill_node(2)  # the whole node: its meshrun launch, agent and worker
        outs = {i: cluster.wait(i, 200) for i in (0, 1)}
    for i, (rc, out) in outs.items():
        assert rc == 0, (i, out[-4000:])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumes = [r for r in rows if r.get("event") == "resume"]
    assert resumes and resumes[-1]["from_step"] >= 3, rows
    assert [r for r in rows if "event" not in r][-1]["step"] == 24
    assert "slow_resumable: world 3, starting at step 0" in outs[0][1]
    assert f"slow_resumable: world 2, starting at step {resumes[-1]['from_step']}" in outs[0][1]


def _wait_for_step(run_dir: Path, step: int, cluster: Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        with suppress(json.JSONDecodeError):  # a line being written
            if metrics.exists() and any(r["step"] >= step for r in _steps(run_dir)):
                return
        for i, proc in cluster.procs.items():
            if proc.poll() is not None:
                pytest.fail(f"node{i} stopped early:\n{cluster.wait(i, 5)[1][-4000:]}")
        time.sleep(0.5)
    pytest.fail(f"step {step} not reached in {timeout} s")


# --- a node cut off from the network exits -------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["by itself", pytest.param("on SIGTERM", marks=pytest.mark.heavy)])
def test_a_host_cut_off_from_the_network_exits(tmp_path: Path, how: str) -> None:
    """Host 1's link goes down mid-run. Its worker ends through the hang watchdog, while its
    agent is blocked in a call to the store it cannot reach (host 0's: the rendezvous's
    every-tick check for waiting nodes): it used to sit there for over 12 minutes, its worker
    a zombie, deaf to SIGTERM. Now it exits 1 saying it lost the rendezvous, or 128 + SIGTERM
    on a SIGTERM, each within a wait bounded by the timeouts it runs under (a hang fails)."""
    # The join timeout bounds both the hosts' first join (they start together) and the wait
    # after the cut (the launcher leaves join_s + RDZV_GRACE_S after its last worker ended).
    join_s, step_timeout_s = 10, 5
    run_dir = tmp_path / "cut"
    train = [
        str(SCRIPTS / "slow_resumable.py"),
        f"--job.run_dir={run_dir}",
        "--optim.steps=400",
        "--checkpoint.interval=5",
        "--data.global_batch=8",
        "--data.micro_batch=4",
        f"--monitor.step_timeout_s={step_timeout_s}",
    ]
    with nodes(2) as cluster:
        for i in (1, 0):  # the non-host first: it waits for the store, then joins
            args = _launch_args(cluster.endpoint, "1:2", 0, "--max-restarts", "3")
            args += ["--rdzv-conf", "last_call_timeout=3", "--join-timeout", str(join_s)]
            cluster.start(i, *args, *train)
        _wait_for_world(run_dir, cluster, timeout=150)
        cluster.net.unplug(1)  # inside host 1's own namespace: only our hosts are involved
        if how == "on SIGTERM":
            time.sleep(step_timeout_s + 8)  # its worker has gone; its agent is in the rendezvous
            os.kill(cluster.procs[1].pid, signal.SIGTERM)
            # The launcher leaves EXIT_AFTER_S after the signal whatever its agent does.
            bound_s = EXIT_AFTER_S + STARTUP_S
        else:
            # The worker's watchdog ends it after the step timeout; the launcher leaves once no
            # worker has run for the join timeout + RDZV_GRACE_S (launch/agent/watch.py).
            bound_s = step_timeout_s + join_s + RDZV_GRACE_S + STARTUP_S
        rc, out = cluster.wait(1, bound_s)  # a host that does not leave fails here
        pids = subprocess.run(
            ["ip", "netns", "pids", cluster.net.names[1]], capture_output=True, text=True
        ).stdout.split()
    print(f"host 1: exit {rc} after the {'SIGTERM' if how != 'by itself' else 'cut'}")
    print(out[-3000:])
    if how == "by itself":
        # Exit 1 with the launcher's own line (its watch, or the agent's rendezvous error).
        assert rc == 1, out[-3000:]
        assert "meshrun launch: lost the rendezvous" in out, out[-3000:]
    else:
        assert rc == 128 + signal.SIGTERM, out[-3000:]
        assert "meshrun launch: stopped by SIGTERM" in out, out[-3000:]
    assert "meshrun watchdog: rank 1 " in out  # its worker ended through the watchdog
    assert pids == [], pids  # nothing left running or unreaped inside host 1


def _wait_for_world(run_dir: Path, cluster: Cluster, timeout: float) -> None:
    """Until the job trains on both hosts (world 2) past a few steps."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        outs = [p for p in cluster.procs.values() if p.poll() is not None]
        if outs:
            pytest.fail(f"a host stopped early:\n{outs[0].communicate()[0][-4000:]}")
        both = (run_dir / "logs" / "rank1.log").exists()  # meshrun's log of the second rank
        with suppress(json.JSONDecodeError, OSError):
            rows = _steps(run_dir) if metrics.exists() else []
            if both and rows and rows[-1]["step"] >= 6:
                return
        time.sleep(0.5)
    pytest.fail(f"the two-host job did not reach step 6 in {timeout} s")
