"""``meshrun doctor`` and ``meshrun launch --doctor`` as users run them: real processes, a
real small ``/dev/shm`` (a tmpfs in a private mount namespace, so the host's is untouched),
a real unreachable master (network namespaces from tests/netns.py), a real 2-process launch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import netns

MESHRUN = [sys.executable, "-m", "meshrun"]


def _run(argv: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _by_name(checks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in checks}


def _small_shm(argv: list[str]) -> list[str]:
    """``argv`` with a 16 MiB tmpfs over /dev/shm, visible to it alone (private mounts)."""
    script = 'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]


def _need_root_and_unshare() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs over /dev/shm in a private namespace needs root")
    if shutil.which("unshare") is None:
        pytest.skip("util-linux `unshare` is not installed")


@pytest.mark.timeout(120)
def test_missing_interface_fails_fast_naming_the_valid_ones(tmp_path: Path) -> None:
    # Refused before any probe waits: the 30 s allowance is imports on a loaded machine.
    r = _run([*MESHRUN, "doctor", "--interface", "nope0"], tmp_path, timeout=30)
    assert r.returncode == 1, r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if "interface" in x)
    assert "FAIL" in line and "'nope0' does not exist" in line and "lo (127.0.0.1/8)" in line
    assert "fix: pass --interface with one of the interfaces listed" in r.stdout
    assert r.stdout.splitlines()[-1].startswith("doctor: FAILED (1 FAIL")


@pytest.mark.timeout(180)
def test_small_dev_shm_fails_locally_and_across_the_launch(tmp_path: Path) -> None:
    _need_root_and_unshare()
    before = shutil.disk_usage("/dev/shm").total
    cfg = tmp_path / "job.toml"
    cfg.write_text("[data]\nnum_workers = 2\n")
    r = _run(_small_shm([*MESHRUN, "doctor", "--json", "--config", str(cfg)]), tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    shm = _by_name(json.loads(r.stdout))["/dev/shm"]
    assert shm["status"] == "FAIL", shm
    assert shm["detail"].startswith("16 MiB, below the 1024 MiB")
    assert "--shm-size" in shm["fix"] and "emptyDir" in shm["fix"]
    # The same through a real launch: every rank checks, the job exits non-zero.
    argv = [
        *MESHRUN,
        "launch",
        "--doctor",
        "--nproc-per-node",
        "2",
        "--set",
        "data.num_workers=2",
        "--set",
        f"job.run_dir={tmp_path / 'run'}",
    ]
    r = _run(_small_shm(argv), tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "FAIL  /dev/shm" in out and "error : DoctorError: FAIL in /dev/shm" in out
    rows = json.loads((tmp_path / "run" / "doctor.json").read_text())
    assert _by_name(rows)["/dev/shm"]["status"] == "FAIL"
    assert shutil.disk_usage("/dev/shm").total == before  # the host's /dev/shm is untouched


@pytest.mark.timeout(180)
def test_unreachable_master_fails_within_seconds() -> None:
    netns.require()
    with netns.hosts(3) as net:
        closed = f"{net.address(0)}:29400"  # node0 answers, nothing listens
        net.unplug(2)
        nobody = f"{net.address(2)}:29400"  # a host off the network: connect times out
        # The three probes at once: each is a process's imports plus a wait (a connect that is
        # refused, one that times out after 3 s, a bind), independent of the others.
        own = f"{net.address(0)}:29401"  # not the refused one: no probe sees another's bind
        probes = [(1, closed), (1, nobody), (0, own)]
        procs = [
            subprocess.Popen(
                net.argv(i, [*MESHRUN, "doctor", "--json", "--rdzv-endpoint", endpoint]),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd="/tmp",
            )
            for i, endpoint in probes
        ]
        # Bounded by the probe's 3 s connect timeout plus imports on a loaded machine.
        outs = [p.communicate(timeout=3 + 90) for p in procs]
        for (out, err), proc, expect in zip(
            outs[:2], procs[:2], ("connection refused", "no answer within 3 s"), strict=True
        ):
            assert proc.returncode == 1, out + err
            checks = _by_name(json.loads(out))
            assert checks["port"]["status"] == "FAIL" and expect in checks["port"]["detail"]
            assert checks["port"]["fix"]
            # The interface is the namespace's veth, chosen by route, not loopback.
            assert checks["interface"]["status"] == "PASS"
            assert checks["interface"]["detail"].startswith(f"{netns.IFNAME} ")
        # On the endpoint's own node the port is checked by binding it.
        (out, err), proc = outs[2], procs[2]
        port = _by_name(json.loads(out))["port"]
        assert port["status"] == "PASS" and "free to host the rendezvous" in port["detail"]
        assert proc.returncode == 0, out + err


@pytest.mark.timeout(180)
def test_healthy_launch_passes_with_all_reduce_and_clock_skew(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [
        *MESHRUN,
        "launch",
        "--doctor",
        "--nproc-per-node",
        "2",
        "--set",
        f"job.run_dir={run_dir}",
    ]
    r = _run(argv, tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "  FAIL  " not in r.stdout and "doctor: ok (0 FAIL" in r.stdout
    assert "meshrun launch --doctor: 2 process(es) on 1 node(s)" in out
    rows = _by_name(json.loads((run_dir / "doctor.json").read_text()))
    assert all(row["status"] != "FAIL" for row in rows.values())
    ar = rows["all-reduce"]
    assert ar["status"] == "PASS" and "16 MiB x 5 on 2 ranks" in ar["detail"]
    gbps = float(ar["detail"].split("bus bandwidth ")[1].split(" GB/s")[0])
    assert gbps > 0
    skew = rows["clock skew"]
    assert skew["status"] == "PASS"
    assert float(skew["detail"].split(" ms")[0]) < 1000  # one machine: one clock
    assert not (run_dir / "metrics.jsonl").exists()  # the check leaves no metrics behind
    print(next(x for x in out.splitlines() if "all-reduce" in x))
    print(next(x for x in out.splitlines() if "clock skew" in x))


@pytest.mark.timeout(240)
def test_two_hosts_launch_doctor_reports_every_node(tmp_path: Path) -> None:
    netns.require()
    run_dir = tmp_path / "run"  # one filesystem: both nodes write the same doctor.json
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    procs: list[subprocess.Popen[str]] = []
    with netns.hosts(2) as net:
        try:
            for i in (1, 0):  # the non-host first: it waits for the store
                argv = [
                    *MESHRUN,
                    "launch",
                    "--doctor",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(i),
                    "--rdzv-endpoint",
                    f"{net.address(0)}:29541",
                    "--nproc-per-node",
                    "1",
                    "--join-timeout",
                    "120",
                    "--set",
                    f"job.run_dir={run_dir}",
                ]
                procs.append(
                    subprocess.Popen(
                        net.argv(i, argv),
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        env=env,
                        cwd=tmp_path,
                    )
                )
            outs = [p.communicate(timeout=180)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    host_out = outs[1]  # node0 prints the table
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    assert "meshrun launch --doctor: 2 process(es) on 2 node(s)" in host_out
    rows = json.loads((run_dir / "doctor.json").read_text())
    interfaces = {r["node"]: r["detail"] for r in rows if r["name"] == "interface"}
    assert set(interfaces) == {"node0", "node1"}  # different addresses: one row per node
    for i in (0, 1):
        assert interfaces[f"node{i}"].startswith(f"{netns.IFNAME} ({net.address(i)}/24)")
    by_name = {r["name"]: r for r in rows}
    assert by_name["versions"]["node"] == "all nodes"
    assert by_name["GLOO_SOCKET_IFNAME"]["detail"] == f"GLOO_SOCKET_IFNAME={netns.IFNAME}"
    assert "on 2 ranks" in by_name["all-reduce"]["detail"]
    assert by_name["clock skew"]["status"] == "PASS"
    assert all(r["status"] != "FAIL" for r in rows)
    print(next(x for x in host_out.splitlines() if "all-reduce" in x))
