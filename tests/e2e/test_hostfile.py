"""``meshrun launch --hostfile`` over real ssh to real "hosts" (network namespaces, as root).

Layout (``netns.hosts(3)``): hosts 1 and 2 are the training nodes, each running its own
``sshd`` (``tests/sshd.py``: key-based root login, listening only on that namespace's address);
host 0 is the machine the user types on. The launcher must run inside host 0, not in the
test's own namespace: the hosts' addresses exist only inside the namespaces, behind their
switch, so the root namespace cannot reach them. All three share the filesystem, which gives
the "same directory, same Python" that a hostfile launch assumes (a shared filesystem).

Each launch costs one ssh check, two remote ``meshrun launch`` startups and two workers'
imports (about 50 s on 2 busy cores), so there are three launches; the guard has its own
local test, and everything pure is in tests/unit/test_hostfile_parse.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import netns
import sshd

pytestmark = [pytest.mark.slow]

LAUNCH_TIMEOUT_S = 240
NODES = (1, 2)  # host indices running sshd and training; host 0 launches


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[netns.Hosts, sshd.SshSetup]]:
    netns.require()
    sshd.require()
    with netns.hosts(3) as net, sshd.servers(net, NODES, tmp_path / "ssh") as ssh:
        yield net, ssh


def _hostfile(net: netns.Hosts, path: Path, extra: str = "") -> Path:
    path.write_text(
        "# training nodes of this test (host 0 launches)\n"
        f"{net.address(1)}\n\n{net.address(2)}   slots=1  # second node\n{extra}"
    )
    return path


def _launch_argv(
    net: netns.Hosts, ssh: sshd.SshSetup, hostfile: Path, run_dir: Path, steps: int, *extra: str
) -> list[str]:
    argv = [sys.executable, "-m", "meshrun", "launch", "--hostfile", str(hostfile)]
    for opt in ssh.ssh_opts:
        argv += ["--ssh-opt", opt]
    argv += ["--nproc-per-node", "1", "-m", "meshrun.demo", "--size", "tiny"]
    # A warmup inside the run: the launcher prints no warning of its own (lines stay whole).
    argv += [f"--optim.steps={steps}", "--optim.warmup_steps=1", f"--job.run_dir={run_dir}", *extra]
    return net.argv(0, argv)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "MESHRUN_CONFIG"}
    env["OMP_NUM_THREADS"] = "1"  # forwarded: the remote banners must show it
    env["MESHRUN_TEST_API_TOKEN"] = "do-not-forward"
    return env


def _leftovers(net: netns.Hosts) -> list[str]:
    """meshrun/torch processes still alive in any of the test's namespaces."""
    found = []
    for name in net.names:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in pids.stdout.split():
            cmdline = _cmdline(int(pid))
            if "meshrun" in cmdline or "torch" in cmdline:
                found.append(f"{name} pid {pid}: {cmdline}")
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _assert_all_gone(net: netns.Hosts) -> None:
    deadline = time.monotonic() + 10  # the launcher waited for every remote guard: no lag
    while (left := _leftovers(net)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == [], left


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None, f"launcher exited {proc.returncode} before {text!r}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout} s"
        time.sleep(0.5)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_hostfile_launch_runs_the_demo_on_two_hosts(
    cluster: tuple[netns.Hosts, sshd.SshSetup], tmp_path: Path
) -> None:
    net, ssh = cluster
    work = tmp_path / "work"  # the launcher's directory: every host cds into it
    work.mkdir()
    hostfile = _hostfile(net, tmp_path / "hosts.txt")
    run_dir = tmp_path / "run"
    done = subprocess.run(
        _launch_argv(net, ssh, hostfile, run_dir, steps=3),
        cwd=work,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, err[-4000:] + out[-2000:]
    a1, a2 = net.address(1), net.address(2)
    assert f"2 hosts ({a1}, {a2}) x 1 processes | rendezvous {a1}:29500" in err
    # Each host's own launch, prefixed; the forwarded OMP_NUM_THREADS; both nodes joined.
    for addr in (a1, a2):
        assert f"[{addr}] meshrun launch: 1 process x 2 nodes" in err
        assert f"[{addr}] meshrun launch: 2 nodes joined [node1, node2]" in err
    assert "OMP_NUM_THREADS=1" in err
    assert f"[{a1}] step 3/3" in out  # global rank 0 lives on the first host
    assert not (run_dir / "job.secret").exists()  # the secret came over ssh's stdin
    # Whole lines only: every line carries exactly one host prefix at its start.
    # split("\n"), not splitlines(): the demo's sample text holds \x0c, \x1c and the like.
    lines = [ln for ln in (out + err).split("\n") if ln.strip()]
    prefixed = [ln for ln in lines if ln.startswith((f"[{a1}] ", f"[{a2}] "))]
    assert len(prefixed) == len(lines) - 1  # all but the launcher's own banner
    assert all(ln.count(f"[{a1}] ") + ln.count(f"[{a2}] ") == 1 for ln in prefixed)
    assert (run_dir / "metrics.jsonl").is_file()
    print(f"hostfile demo: {len(prefixed)} prefixed lines; tail: {out.split(chr(10))[-2]!r}")
    _assert_all_gone(net)


def _agent_pid(net: netns.Hosts, host: int) -> int:
    """The ``python -m meshrun launch`` process (the torchrun agent) inside ``host``."""
    pids = subprocess.run(["ip", "netns", "pids", net.names[host]], capture_output=True, text=True)
    for pid in map(int, pids.stdout.split()):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if argv[1:4] == [b"-m", b"meshrun", b"launch"]:
            return pid
    raise AssertionError(f"no meshrun launch process in host {host}")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_long_run(
    net: netns.Hosts, ssh: sshd.SshSetup, tmp_path: Path, ignore_sigint: bool = False
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    work = tmp_path / "work"
    work.mkdir()
    out, err = tmp_path / "launcher.out", tmp_path / "launcher.err"
    argv = _launch_argv(net, ssh, _hostfile(net, tmp_path / "hosts.txt"), tmp_path / "run", 10**6)
    pre = _ignore_sigint if ignore_sigint else None
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(
            argv, cwd=work, env=_env(), stdout=o, stderr=e, preexec_fn=pre, restore_signals=True
        )
    # Training is under way on both hosts once global rank 0 logs a step.
    _wait_for(out, f"[{net.address(1)}] step ", proc, LAUNCH_TIMEOUT_S)
    return proc, out, err


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_a_killed_host_stops_the_others(
    cluster: tuple[netns.Hosts, sshd.SshSetup], tmp_path: Path
) -> None:
    net, ssh = cluster
    proc, _, err = _start_long_run(net, ssh, tmp_path)
    try:
        killed_at = time.monotonic()
        os.kill(_agent_pid(net, 2), signal.SIGKILL)  # host 2's meshrun launch dies
        code = proc.wait(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text(errors="replace")
    a1, a2 = net.address(1), net.address(2)
    assert code != 0, text[-3000:]
    assert f"host {a2} (line 4) failed first: exit code 137" in text, text[-3000:]
    assert f"stopping the other hosts: {a1}" in text
    print(f"killed host 2's agent: launcher exited {code} after {took:.1f} s")
    _assert_all_gone(net)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
def test_ctrl_c_stops_every_host(
    cluster: tuple[netns.Hosts, sshd.SshSetup], tmp_path: Path
) -> None:
    net, ssh = cluster
    # Started with SIGINT ignored, as from a shell without job control (a script's `cmd &`):
    # the launcher must stop on it all the same (it did not: Python installs no handler then).
    proc, _, err = _start_long_run(net, ssh, tmp_path, ignore_sigint=True)
    try:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the launcher
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.read_text(errors="replace")
    assert code == 130, text[-3000:]
    assert "stopped by SIGINT; stopping all hosts" in text
    _assert_all_gone(net)


@pytest.mark.timeout(120)
def test_an_unreachable_host_fails_before_anything_starts(
    cluster: tuple[netns.Hosts, sshd.SshSetup], tmp_path: Path
) -> None:
    net, ssh = cluster
    # Host 0 runs no sshd (refused at once); address(8) is no host at all (no answer).
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{net.address(1)}\n{net.address(0)}\n{net.address(8)}\n")
    start = time.monotonic()
    done = subprocess.run(
        # 3 hosts x 1 process: a global batch that divides (the config is checked first).
        _launch_argv(net, ssh, hostfile, tmp_path / "run", 3, "--data.global_batch=24"),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    took = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    assert "2 of 3 hosts in" in done.stderr and "nothing was started" in done.stderr
    assert f"{net.address(0)} (line 2): ssh {net.address(0)} failed" in done.stderr
    assert f"{net.address(8)} (line 3)" in done.stderr
    assert f"{net.address(1)} (line 1)" not in done.stderr
    print(f"unreachable hosts reported in {took:.1f} s:\n{done.stderr}")
    _assert_all_gone(net)


@pytest.mark.timeout(60)
def test_the_guard_stops_its_command_and_orphans_when_stdin_closes(tmp_path: Path) -> None:
    # What runs on each host: a child that starts a grandchild in its own session (as torch
    # starts workers), then the ssh channel closes. No namespace or root needed.
    child = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
        "print(p.pid, flush=True); time.sleep(300)"
    )
    guard = subprocess.Popen(
        [sys.executable, "-m", "meshrun.launch.hostfile.guard", "--", sys.executable, "-c", child],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert guard.stdout is not None and guard.stdin is not None
        grandchild = int(guard.stdout.readline())
        assert Path(f"/proc/{grandchild}").exists()
        guard.stdin.close()  # the ssh session ends
        code = guard.wait(timeout=30)
    finally:
        if guard.poll() is None:
            guard.kill()
    assert code == 128 + signal.SIGTERM  # the child was stopped by the guard's SIGTERM
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
