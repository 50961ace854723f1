"""Run a ``HostfilePlan`` over ssh: check the hosts, start one launch per host, stream their
output with a ``[host]`` prefix, and stop them all when one fails or on Ctrl-C/SIGTERM.

Stopping a host means closing its ssh client's stdin: the remote guard (``launch/hostfile/guard.py``)
sees the channel end and stops that host's ``meshrun launch`` (which stops its workers), so the
host's last lines still arrive. A host that has not exited after ``STOP_GRACE_S`` gets its ssh
client terminated, which ends the channel just the same.
"""

from __future__ import annotations

import os
import queue
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import IO

from meshrun.launch.hostfile.hosts import HostEntry, HostfileError, HostfilePlan
from meshrun.launch.trust.secret import SECRET_FILE_ENV, resolve
from meshrun.runtime.secret import SECRET_ENV, SecretError

CHECK_TIMEOUT_S = 15.0  # per host, all hosts in parallel; ssh's own ConnectTimeout is shorter
STOP_GRACE_S = 25.0  # > the guard's SIGTERM -> SIGKILL grace, so remote cleanup can finish
EXIT_INTERRUPTED = 130
_SSH_FAILED = 255  # ssh's own exit status when it cannot connect or authenticate
SSH_CONNECT_TIMEOUT_S = 5
GUARD_MODULE = "meshrun.launch.hostfile.guard"
READ_SECRET = 'IFS= read -r MESHRUN_JOB_SECRET && export MESHRUN_JOB_SECRET && exec "$@"'


class _Stopped(Exception):
    def __init__(self, sig: signal.Signals) -> None:
        self.sig = sig


@dataclass
class _Host:
    index: int
    entry: HostEntry
    proc: subprocess.Popen[bytes]
    readers: list[threading.Thread]


def check_hosts(plan: HostfilePlan) -> None:
    """Every host answers ssh and has the directory and Python (in parallel), else one error
    naming each host that does not and why."""
    with ThreadPoolExecutor(max_workers=min(32, len(plan.hosts))) as pool:
        problems = [p for p in pool.map(lambda h: _check_one(plan, h), plan.hosts) if p]
    if problems:
        raise HostfileError(
            f"{len(problems)} of {len(plan.hosts)} hosts in {plan.source} are not ready; "
            "nothing was started:\n  " + "\n  ".join(problems)
        )


def _check_one(plan: HostfilePlan, entry: HostEntry) -> str | None:
    argv = ssh_argv(entry, plan.ssh_args, check_command(plan))
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"{entry.label} (line {entry.line}): no answer over ssh in {CHECK_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        return None
    said = " ".join(done.stderr.split()[-40:]) or f"exit code {done.returncode}"
    if done.returncode == _SSH_FAILED:
        return f"{entry.label} (line {entry.line}): ssh {entry.destination} failed: {said} ({_hint(said)})"
    return (
        f"{entry.label} (line {entry.line}): {plan.cwd!r} or {plan.python!r} is missing there; "
        "every host needs the same directory and Python at the same path"
    )


def _hint(said: str) -> str:
    if "Permission denied" in said:
        return (
            "log in needs a key: BatchMode never asks for a password; give the key with "
            "--ssh-opt IdentityFile=PATH or load it into ssh-agent"
        )
    if "Host key verification failed" in said:
        return (
            "the host's key is not in known_hosts: ssh to it once, or set "
            "StrictHostKeyChecking in your ssh config"
        )
    return "is sshd running there, and the address reachable from this machine?"


def run_plan(plan: HostfilePlan, secret: str) -> int:
    """Start every host, stream, stop all on the first failure or a signal; the exit code."""
    lock = threading.Lock()
    hosts: list[_Host] = []
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    with _stop_signals():
        try:
            for i, entry in enumerate(plan.hosts):
                hosts.append(_start(plan, i, entry, lock, secret))
                threading.Thread(target=_wait, args=(hosts[-1], exits), daemon=True).start()
            return _supervise(hosts, exits, lock)
        except (_Stopped, KeyboardInterrupt) as err:
            sig = err.sig if isinstance(err, _Stopped) else signal.SIGINT
            _say(lock, f"stopped by {sig.name}; stopping all hosts")
            _stop(hosts, lock)
            return EXIT_INTERRUPTED if sig == signal.SIGINT else 128 + int(sig)


def job_secret(environ: Mapping[str, str]) -> str:
    """The secret every host's launch gets: the user's (``MESHRUN_JOB_SECRET`` or
    ``MESHRUN_JOB_SECRET_FILE``), else a new one for this launch."""
    if not (environ.get(SECRET_ENV) or environ.get(SECRET_FILE_ENV)):
        return secrets.token_hex(32)
    try:
        return resolve("", environ, create=False).key.decode()
    except SecretError as err:
        raise HostfileError(str(err)) from None


def _start(
    plan: HostfilePlan, index: int, entry: HostEntry, lock: threading.Lock, secret: str
) -> _Host:
    argv = ssh_argv(entry, plan.ssh_args, remote_command(plan, index))
    # Its own session: a Ctrl-C in the terminal reaches only this launcher, which then stops
    # the hosts in order (and keeps streaming their last lines) instead of ssh dying at once.
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(secret.encode() + b"\n")  # the remote sh reads it (hostfile.READ_SECRET)
    proc.stdin.flush()
    readers = [
        threading.Thread(target=_stream, args=(pipe, out, entry.label, lock), daemon=True)
        for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))
    ]
    for reader in readers:
        reader.start()
    return _Host(index, entry, proc, readers)


def _stream(pipe: IO[bytes], out: IO[str], label: str, lock: threading.Lock) -> None:
    """Copy ``pipe`` to ``out`` line by line with a ``[label]`` prefix; one write per line,
    under a lock shared by all hosts, so lines never interleave."""
    for raw in iter(pipe.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n")
        with lock:
            out.write(f"[{label}] {line}\n")
            out.flush()
    pipe.close()


def _wait(host: _Host, exits: queue.Queue[tuple[int, int]]) -> None:
    exits.put((host.index, host.proc.wait()))


def _supervise(
    hosts: list[_Host], exits: queue.Queue[tuple[int, int]], lock: threading.Lock
) -> int:
    """Wait for every host; the first to fail stops the others and sets the exit code."""
    pending = {h.index for h in hosts}
    while pending:
        index, code = _next_exit(exits)
        pending.discard(index)
        if code != 0:
            failed = hosts[index]
            _join_readers(failed)  # its last lines (the failure summary) before ours
            others = [h.entry.label for h in hosts if h.index in pending]
            _say(lock, _failure_line(failed, code, others))
            _stop([h for h in hosts if h.index in pending], lock)
            return code if 0 < code < 256 else 1
    for host in hosts:
        _join_readers(host)
    return 0


def _next_exit(exits: queue.Queue[tuple[int, int]]) -> tuple[int, int]:
    while True:  # a timeout, so that signals are handled while waiting
        try:
            return exits.get(timeout=0.5)
        except queue.Empty:
            continue


def _failure_line(host: _Host, code: int, others: list[str]) -> str:
    what = "ssh failed (connection lost?)" if code == _SSH_FAILED else f"exit code {code}"
    text = f"host {host.entry.label} (line {host.entry.line}) failed first: {what}"
    return text + (f"; stopping the other hosts: {', '.join(others)}" if others else "")


def _stop(hosts: list[_Host], lock: threading.Lock) -> None:
    """Close every ssh stdin (the remote guards stop their launch), wait, then terminate."""
    for host in hosts:
        _close_stdin(host)
    deadline = time.monotonic() + STOP_GRACE_S
    for host in hosts:
        try:
            host.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _say(lock, f"host {host.entry.label} did not stop in {STOP_GRACE_S:.0f} s; ending ssh")
            host.proc.terminate()
            try:
                host.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                host.proc.kill()
                host.proc.wait()
    for host in hosts:
        _join_readers(host)


def _close_stdin(host: _Host) -> None:
    try:
        if host.proc.stdin is not None:
            host.proc.stdin.close()
    except OSError:
        pass  # ssh already gone


def _join_readers(host: _Host) -> None:
    for reader in host.readers:
        reader.join(timeout=5)


def _say(lock: threading.Lock, text: str) -> None:
    with lock:
        print(f"meshrun launch --hostfile: {text}", file=sys.stderr, flush=True)


@contextmanager
def _stop_signals() -> Iterator[None]:
    """SIGINT, SIGTERM (and SIGHUP) raise ``_Stopped`` in the main thread, so each stops the
    hosts the same way; the handlers are put back after. SIGINT is handled here too, not left
    to Python's KeyboardInterrupt: a launcher started from a shell without job control (a
    script's ``cmd &``, CI) inherits SIGINT ignored, and Python then installs no handler, so
    ``kill -INT`` did nothing (torchrun's agent handles it whatever it inherited)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Stopped(signal.Signals(signum))

    sigs = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    saved = {sig: signal.getsignal(sig) for sig in sigs}
    for sig in sigs:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def launch_hostfile(plan: HostfilePlan) -> int:
    """Check the hosts, print the plan, run it."""
    secret = job_secret(os.environ)
    check_hosts(plan)
    labels = ", ".join(h.label for h in plan.hosts)
    print(
        f"meshrun launch --hostfile: {len(plan.hosts)} hosts ({labels}) x "
        f"{plan.nproc_per_node or 'default'} processes | rendezvous {plan.endpoint} id {plan.rdzv_id} | "
        f"cwd {plan.cwd} | python {plan.python}",
        file=sys.stderr,
        flush=True,
    )
    return run_plan(plan, secret)


# --- what ssh runs on each host ----------------------------------------------------------


def ssh_argv(entry: HostEntry, ssh_args: Sequence[str], command: str) -> list[str]:
    """``ssh`` to ``entry`` running the shell ``command``. BatchMode: never prompt for a
    password (it would hang a launcher with several hosts). The user's options come first
    because ssh keeps the first value it gets for each option."""
    argv = ["ssh", *ssh_args, "-o", "BatchMode=yes"]
    argv += ["-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}"]
    if entry.port:
        argv += ["-p", str(entry.port)]
    return [*argv, entry.destination, command]


def node_argv(plan: HostfilePlan, node_rank: int) -> list[str]:
    """The ``meshrun launch`` argv for host ``node_rank`` (before quoting)."""
    return [
        *(plan.python, "-m", "meshrun", "launch"),
        *("--nnodes", str(len(plan.hosts))),
        *("--node-rank", str(node_rank)),
        *("--rdzv-endpoint", plan.endpoint),
        *("--rdzv-id", plan.rdzv_id),
        *(["--nproc-per-node", str(plan.nproc_per_node)] if plan.nproc_per_node else []),
        *plan.launch_args,
    ]


def remote_command(plan: HostfilePlan, node_rank: int) -> str:
    """The shell line ssh runs on host ``node_rank``: same directory, same Python, the
    forwarded variables, and the guard that stops the launch when the ssh session ends.
    The job secret is the first line the launcher writes to ssh's stdin (a command line
    would show it in ``ps``): ``sh`` reads it into the environment, the guard gets the rest."""
    env = [f"{k}={v}" for k, v in plan.env.items()]
    guard = [plan.python, "-m", GUARD_MODULE, "--"]
    return f"cd {shlex.quote(plan.cwd)} && exec " + shlex.join(
        ["sh", "-c", READ_SECRET, "sh", "env", *env, *guard, *node_argv(plan, node_rank)]
    )


def check_command(plan: HostfilePlan) -> str:
    """What the reachability check runs: the directory and the Python must exist there."""
    return f"cd {shlex.quote(plan.cwd)} && test -x {shlex.quote(plan.python)}"
