"""``meshrun doctor``'s checks, driven with made-up inputs (no processes, no namespaces), and
the merge of every rank's checks into one table."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from meshrun.cli.main import build_parser, launch_request, use_doctor_worker
from meshrun.cli.main import main as cli_main
from meshrun.diagnose import doctor_checks as dc
from meshrun.diagnose.doctor import WORKER_MODULE, exit_code, render
from meshrun.diagnose.doctor_checks import Check
from meshrun.diagnose.doctor_worker import merge

pytestmark = pytest.mark.timeout(60)


def test_gpus_against_processes() -> None:
    cpu = dc.check_gpus(0, 2)
    assert cpu.status == "PASS" and "Gloo" in cpu.detail
    few = dc.check_gpus(2, 4)
    assert few.status == "FAIL" and "--nproc-per-node 2" in few.fix
    idle = dc.check_gpus(8, 4)
    assert idle.status == "WARN" and "4 GPU(s) idle" in idle.detail
    assert dc.check_gpus(4, 4).status == "PASS"


def test_missing_interface_fails_naming_the_valid_ones() -> None:
    c = dc.check_interface("127.0.0.1", "nope0", multi_host=False)
    assert c.status == "FAIL"
    assert "'nope0' does not exist" in c.detail and "lo (127.0.0.1/8)" in c.detail
    assert "--interface" in c.fix


def test_loopback_is_fine_on_one_node_and_never_across_hosts() -> None:
    one = dc.check_interface("127.0.0.1", "", multi_host=False)
    assert one.status == "PASS" and "loopback is fine" in one.detail
    many = dc.check_interface("127.0.0.1", "", multi_host=True)
    assert many.status == "FAIL" and "loopback" in many.detail


def test_port_bind_fails_when_taken_and_connect_fails_when_closed() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        taken = dc.check_port("127.0.0.1", port, bind=True)
        assert taken.status == "FAIL" and "choose another port" in taken.fix
        reached = dc.check_port("127.0.0.1", port, bind=False)
        assert reached.status == "PASS"
    closed = dc.check_port("127.0.0.1", port, bind=False, timeout=2)
    assert closed.status == "FAIL" and "connection refused" in closed.detail
    assert "start the node that owns the rendezvous endpoint first" in closed.fix
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    assert dc.check_port("127.0.0.1", free, bind=True).status == "PASS"


def test_split_endpoint() -> None:
    assert dc.split_endpoint("10.0.0.1:29400") == ("10.0.0.1", 29400)
    for bad in ("10.0.0.1", ":29400", "host:http", "host:70000"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            dc.split_endpoint(bad)


def test_socket_ifname_variables() -> None:
    names = ["lo", "eth0", "ib0"]
    assert dc.check_socket_ifname("GLOO_SOCKET_IFNAME", {}, names) is None
    ok = dc.check_socket_ifname("GLOO_SOCKET_IFNAME", {"GLOO_SOCKET_IFNAME": "eth0"}, names)
    assert ok is not None and ok.status == "PASS"
    # Gloo wants exact names; NCCL takes prefixes, "=" for exact and "^" to exclude.
    gloo = dc.check_socket_ifname("GLOO_SOCKET_IFNAME", {"GLOO_SOCKET_IFNAME": "eth"}, names)
    assert gloo is not None and gloo.status == "FAIL" and "'eth'" in gloo.detail
    assert "lo, eth0, ib0" in gloo.detail and "unset GLOO_SOCKET_IFNAME" in gloo.fix
    env = {"NCCL_SOCKET_IFNAME": "eth"}
    assert dc.check_socket_ifname("NCCL_SOCKET_IFNAME", env, names).status == "PASS"  # type: ignore[union-attr]
    env = {"NCCL_SOCKET_IFNAME": "=eth"}
    assert dc.check_socket_ifname("NCCL_SOCKET_IFNAME", env, names).status == "FAIL"  # type: ignore[union-attr]
    env = {"NCCL_SOCKET_IFNAME": "^docker"}
    assert dc.check_socket_ifname("NCCL_SOCKET_IFNAME", env, names).status == "PASS"  # type: ignore[union-attr]


def test_nccl_switches_warn() -> None:
    assert dc.check_nccl_env({"NCCL_DEBUG": "WARN", "NCCL_IB_DISABLE": "0"}) == []
    found = dc.check_nccl_env(
        {"NCCL_DEBUG": "INFO", "NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    )
    assert [c.name for c in found] == ["NCCL_DEBUG", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"]
    assert all(c.status == "WARN" and c.fix for c in found)


def test_omp_threads_against_cores() -> None:
    assert dc.check_omp({}, 2, 8).status == "PASS"
    over = dc.check_omp({"OMP_NUM_THREADS": "4"}, 4, 8)
    assert over.status == "WARN" and "16 threads for 8 cores" in over.detail
    assert "OMP_NUM_THREADS=2" in over.fix
    assert dc.check_omp({"OMP_NUM_THREADS": "x"}, 2, 8).status == "FAIL"
    assert dc.check_omp({"OMP_NUM_THREADS": "2"}, 4, 8).status == "PASS"


def test_shm_threshold() -> None:
    assert dc.shm_needed(gpus=0, num_workers=0, nproc=2) == 0
    assert dc.shm_needed(gpus=8, num_workers=0, nproc=8) == dc.SHM_MIN
    assert dc.shm_needed(gpus=0, num_workers=8, nproc=8) > dc.SHM_MIN  # 64 workers
    small = dc.check_shm(64 * dc.MiB, dc.SHM_MIN)
    assert small.status == "FAIL" and "64 MiB, below the 1024 MiB" in small.detail
    assert "--shm-size" in small.fix and "emptyDir" in small.fix
    assert dc.check_shm(64 * dc.MiB, 0).status == "WARN"  # Gloo without workers: works
    assert dc.check_shm(2 * dc.SHM_MIN, dc.SHM_MIN).status == "PASS"
    assert dc.check_shm(None, dc.SHM_MIN).status == "WARN"


def test_disk_thresholds_and_estimate(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    assert dc.check_disk(d, 100 * dc.GiB, None).status == "PASS"
    assert dc.check_disk(d, 5 * dc.GiB, None).status == "WARN"
    low = dc.check_disk(d, dc.GiB // 2, None)
    assert low.status == "FAIL" and "checkpoint.dir" in low.fix
    assert dc.checkpoint_estimate(d, keep_last=3) is None
    step = d / "step_00000010"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"x" * 1000)
    estimate = dc.checkpoint_estimate(d, keep_last=3)
    assert estimate == 4000  # the newest checkpoint x (3 kept + 1 being written)
    assert dc.check_disk(d, 3000, estimate).status == "FAIL"
    assert dc.check_disk(d, 5000, estimate).status == "PASS"
    where, free = dc.disk_free(d / "not" / "yet")
    assert where == d and free > 0


def _report(host: str, node_rank: int, checks: list[Check]) -> dict[str, object]:
    return {"rank": node_rank, "node_rank": node_rank, "host": host, "checks": dc.as_dicts(checks)}


def test_merge_collapses_agreeing_nodes_and_fails_on_version_mismatch() -> None:
    shm = Check("/dev/shm", "PASS", "8192 MiB")
    reports = [
        _report("a", 0, [Check("versions", "PASS", "torch 2.13"), shm]),
        _report("a", 0, [Check("versions", "PASS", "torch 2.13"), shm]),  # a second rank on a
        _report("b", 1, [Check("versions", "PASS", "torch 2.12"), shm]),
    ]
    rows = merge(reports)
    assert [(node, c.name, c.status) for node, c in rows] == [
        ("a", "versions", "FAIL"),
        ("b", "versions", "FAIL"),
        ("all nodes", "/dev/shm", "PASS"),
    ]
    assert "same python, torch and meshrun" in rows[0][1].fix
    assert exit_code([c for _, c in rows]) == 1


def test_merge_on_one_node_has_no_node_column() -> None:
    rows = merge([_report("a", 0, [Check("x", "PASS", "ok")])] * 2)
    assert rows == [("", Check("x", "PASS", "ok"))]


def test_render_prints_fixes_and_the_verdict() -> None:
    rows = [("", Check("port", "FAIL", "refused", "start it")), ("", Check("gpus", "PASS", "0"))]
    text = render(rows, "title")
    assert "  FAIL  port  refused" in text and "fix: start it" in text
    assert text.splitlines()[-1] == "doctor: FAILED (1 FAIL, 0 WARN, 1 PASS)"
    assert exit_code([Check("a", "WARN", "")]) == 0


def test_cli_doctor_json_and_exit_code(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = cli_main(["doctor", "--json", "--interface", "nope0", "--checkpoint-dir", str(tmp_path)])
    checks = json.loads(capsys.readouterr().out)
    assert code == 1
    by_name = {c["name"]: c for c in checks}
    assert by_name["interface"]["status"] == "FAIL"
    assert {"versions", "gpus", "port", "hostname", "/dev/shm", "disk"} <= set(by_name)


def test_cli_doctor_rejects_a_bad_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["doctor", "--rdzv-endpoint", "nohostport"]) == 2
    assert "expected HOST:PORT" in capsys.readouterr().err


def test_launch_doctor_runs_the_worker_module() -> None:
    parsed = build_parser().parse_args(["launch", "--doctor", "--nproc-per-node", "2"])
    assert parsed.doctor and parsed.target is None
    a = use_doctor_worker(launch_request(parsed))
    assert (a.target, a.module) == (WORKER_MODULE, True)
    assert ("metrics.jsonl", "false") in a.sets
