"""``meshrun launch`` as a drop-in for ``torchrun``: the same command lines, real processes, and
stdout compared byte for byte with torchrun's own run of the same plain script.

Each launch costs a few seconds of torch imports per worker on 2 cores, so the checks are
grouped: one pair of runs per command line, every run under a timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import netns
from meshrun.runtime.ports import free_port

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "scripts" / "torchrun_compat_print.py"
RUN_TIMEOUT_S = 150
MESHRUN = [sys.executable, "-m", "meshrun", "launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MESHRUN_"))}
    return {**env, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _run(argv: list[str], cwd: Path, stdout_file: Path | None = None) -> tuple[int, str, str]:
    """Run ``argv``; stdout to ``stdout_file`` (a plain file, as `> file`) or a pipe."""
    if stdout_file is None:
        done = subprocess.run(
            argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
        return done.returncode, done.stdout, done.stderr
    with stdout_file.open("wb") as out:
        done = subprocess.run(
            argv, cwd=cwd, env=_env(), stdout=out, stderr=subprocess.PIPE, timeout=RUN_TIMEOUT_S
        )
    return done.returncode, stdout_file.read_text(), done.stderr.decode(errors="replace")


def _rank_lines(n: int) -> list[str]:
    """The stdout lines every rank writes, in rank order (GROUP_RANK 0: one node)."""
    lines = []
    for rank in range(n):
        lines += [
            f"rank {rank}/{n} LOCAL_RANK={rank} GROUP_RANK=0 LOCAL_WORLD_SIZE={n} "
            "ROLE_NAME=default TORCHELASTIC_MAX_RESTARTS=0",
            f"rank {rank} says: no prefix on this line",
        ]
    return lines


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
def test_standalone_stdout_to_a_file_is_byte_identical_to_torchruns(tmp_path: Path) -> None:
    flags = ["--standalone", "--nproc_per_node=2", str(SCRIPT)]
    rc_t, _, err_t = _run([*TORCHRUN, *flags], tmp_path, tmp_path / "torchrun.out")
    assert rc_t == 0, err_t[-3000:]
    run_dir = tmp_path / "run"
    rc_m, out_m, err_m = _run(
        [*MESHRUN, "--set", f"job.run_dir={run_dir}", *flags], tmp_path, tmp_path / "meshrun.out"
    )
    assert rc_m == 0, err_m[-3000:]
    assert (tmp_path / "torchrun.out").read_bytes() == (tmp_path / "meshrun.out").read_bytes()
    assert out_m.splitlines() == [*_rank_lines(2), "done"]  # no "[default0]:", no banner
    # meshrun's own lines go to stderr; the workers' stderr is kept for the failure summary
    # (printed with torchrun's tee prefix).
    assert "meshrun launch: 2 processes x 1 node | rendezvous 127.0.0.1:" in err_m
    assert "[default1]:rank 1 on stderr" in err_m and "rank 1 on stderr" in err_t
    logs = sorted((run_dir / "logs").glob("meshrun_*/attempt_0/1/stderr.log"))
    assert logs and "rank 1 on stderr" in logs[-1].read_text()


# heavy (CI's time): torchrun's own command lines stay in CI in this file's byte-identical and
# static multinode tests
@pytest.mark.heavy
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
def test_torchruns_other_flags_reach_the_agent_with_torchruns_meaning(tmp_path: Path) -> None:
    """A command line with many of torchrun's flags, underscore spelling, as torchrun runs it:
    the same stdout (rank 1 filtered out, the role renamed, the script run as a program)."""

    def flags(log_dir: Path) -> list[str]:
        return [
            "--standalone",
            "--nproc_per_node=2",
            "--monitor_interval=0.2",
            "--start_method=spawn",
            "--role=trainer",
            "--local_ranks_filter=0",
            "--signals_to_handle=SIGTERM,SIGINT",
            "--shutdown_timeout=5",
            "--max_restarts=0",
            "--rdzv_id=compat",
            f"--log_dir={log_dir}",
            "--local_addr=127.0.0.1",
            "--duplicate_stdout_filters=says",
            "--no_python",
            sys.executable,
            str(SCRIPT),
        ]

    rc_t, out_t, err_t = _run([*TORCHRUN, *flags(tmp_path / "t")], tmp_path)
    assert rc_t == 0, err_t[-3000:]
    logs = tmp_path / "m"
    rc_m, out_m, err_m = _run(
        [*MESHRUN, "--set", f"job.run_dir={tmp_path / 'run'}", *flags(logs)], tmp_path
    )
    assert rc_m == 0, err_m[-3000:]
    assert out_m == out_t
    assert out_m.splitlines() == [
        "rank 0/2 LOCAL_RANK=0 GROUP_RANK=0 LOCAL_WORLD_SIZE=2 ROLE_NAME=trainer "
        "TORCHELASTIC_MAX_RESTARTS=0",
        "rank 0 says: no prefix on this line",
        "done",
    ]
    assert "[trainer0]:rank 0 on stderr" in err_m and "rank 1 on stderr" not in err_m
    assert f"logs {logs}" in err_m  # the user's --log_dir, where the summary then looks
    assert "rank 1 on stderr" in next(logs.glob("compat_*/attempt_0/1/stderr.log")).read_text()


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
def test_torchruns_static_multinode_line_on_one_host_works_as_in_torchrun(tmp_path: Path) -> None:
    port = free_port()
    flags = [
        "--nnodes=1",
        "--node_rank=0",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "--nproc_per_node=2",
        str(SCRIPT),
    ]
    rc_m, out_m, err_m = _run([*MESHRUN, "--set", f"job.run_dir={tmp_path}", *flags], tmp_path)
    assert rc_m == 0, err_m[-3000:]
    assert f"rendezvous static 127.0.0.1:{port}" in err_m  # torchrun's static backend
    assert "1 nodes joined" in err_m  # and meshrun's checked handshake on its store
    rc_t, out_t, err_t = _run([*TORCHRUN, *flags], tmp_path)  # stdout through a pipe
    assert rc_t == 0, err_t[-3000:]
    assert out_m == out_t
    assert out_m.splitlines() == [*_rank_lines(2), "done"]


# heavy (CI's time): torchrun's own command lines stay in CI in this file's byte-identical and
# static multinode tests
@pytest.mark.heavy
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
def test_nproc_per_node_auto_and_cpu_count_cpu_cores_as_torchrun(tmp_path: Path) -> None:
    if torch.accelerator.is_available():
        pytest.skip("with an accelerator auto counts devices")
    cores = sorted(os.sched_getaffinity(0))[:2]  # the workers' count follows the affinity
    n = len(cores)
    taskset = ["taskset", "-c", ",".join(map(str, cores))]
    for word, tee in (("auto", ["--tee", "3"]), ("cpu", [])):
        argv = [
            *taskset,
            *MESHRUN,
            "--nproc-per-node",
            word,
            *tee,
            "--set",
            f"job.run_dir={tmp_path / word}",
            str(SCRIPT),
        ]
        rc, out, err = _run(argv, tmp_path)
        assert rc == 0, err[-3000:]
        assert f"meshrun launch: --nproc-per-node {word}: {n} processes" in err
        if tee:  # torchrun's own --tee 3: every line with its rank prefix
            assert f"[default0]:{_rank_lines(n)[0]}" in out.splitlines()
        else:
            assert out.splitlines() == [*_rank_lines(n), "done"]


def _kill_hosts(net: netns.Hosts, procs: list[subprocess.Popen[str]]) -> None:
    """SIGKILL whatever still runs in the hosts (the agent puts each worker in a session of
    its own, so killing the launcher's process group is not enough)."""
    for i, proc in zip((1, 0), procs, strict=False):
        if proc.poll() is None:
            found = subprocess.run(
                ["ip", "netns", "pids", net.names[i]], capture_output=True, text=True
            ).stdout.split()
            for pid in [proc.pid, *map(int, found)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.communicate()


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_static_rendezvous_on_two_hosts_gives_each_node_its_rank(tmp_path: Path) -> None:
    """torchrun's --nnodes=2 --node_rank=R --master_addr=... --master_port=... on two
    network-namespace hosts: the node rank is the group rank, as with torchrun."""
    netns.require()
    procs: list[subprocess.Popen[str]] = []
    with netns.hosts(2) as net:
        try:
            for i in (1, 0):  # the non-master first: it waits for the master's store
                argv = [
                    *MESHRUN,
                    "--nnodes=2",
                    f"--node_rank={i}",
                    f"--master_addr={net.address(0)}",
                    "--master_port=29561",
                    "--nproc_per_node=1",
                    "--join-timeout",
                    "90",
                    "--set",
                    f"job.run_dir={tmp_path}",
                    str(SCRIPT),
                ]
                procs.append(
                    subprocess.Popen(
                        net.argv(i, argv),
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        env=_env(),
                        start_new_session=True,
                    )
                )
            outs = [p.communicate(timeout=RUN_TIMEOUT_S) for p in procs]
        finally:
            _kill_hosts(net, procs)
    (out1, err1), (out0, err0) = outs
    assert [p.returncode for p in procs] == [0, 0], (err0[-2000:], err1[-2000:])
    assert "2 nodes joined [node0, node1]" in err0
    assert out0.splitlines() == [
        "rank 0/2 LOCAL_RANK=0 GROUP_RANK=0 LOCAL_WORLD_SIZE=1 ROLE_NAME=default "
        "TORCHELASTIC_MAX_RESTARTS=0",
        "rank 0 says: no prefix on this line",
        "done",
    ]
    assert out1.splitlines() == [
        "rank 1/2 LOCAL_RANK=0 GROUP_RANK=1 LOCAL_WORLD_SIZE=1 ROLE_NAME=default "
        "TORCHELASTIC_MAX_RESTARTS=0",
        "rank 1 says: no prefix on this line",
    ]
