"""A real one-node SLURM cluster for tests (Debian's slurm-wlm and munge; needs root).

``cluster()`` writes a munge key, ``slurm.conf`` and ``cgroup.conf`` into a temp dir, starts
``munged``, ``slurmctld -D`` and ``slurmd -D`` in the background with ``SLURM_CONF`` pointing
there, waits (bounded) until ``sinfo`` shows the node idle, and stops and removes everything
on exit, also when the test fails. Nothing under /etc is read or changed: every path, the
munge socket and both daemon ports are private to the cluster.

Accounting: 22.05 has no ``accounting_storage/filetxt`` and ``accounting_storage/none`` gives
no ``sacct``, so jobs are checked with ``scontrol show job`` (``MinJobAge`` keeps finished jobs
in memory) and the ``jobcomp/filetxt`` completion log, which ``Slurm.job_state`` reads.

    with slurm.cluster() as s:
        job = s.run(["sbatch", "--parsable", "job.sh"]).stdout.strip()
        s.wait_job(job, timeout=120)  # "COMPLETED"

or, for a whole session, the fixture ``cluster``: ``cluster = slurm.slurm_cluster`` in a test
module, then ``def test_x(cluster: slurm.Slurm)``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from meshrun.runtime.ports import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "sinfo", "squeue")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def available() -> str | None:
    """None if a SLURM cluster can be started here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "a private SLURM cluster needs root (slurmd runs jobs as their user)"
    missing = [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b) is None]
    if missing:
        return f"SLURM/munge binaries not found: {', '.join(missing)} (apt-get install slurm-wlm)"
    return None


def require() -> None:
    reason = available()
    if reason:
        pytest.skip(reason)


@dataclass
class Slurm:
    root: Path  # the temp dir holding the config, state, logs
    hostname: str
    partition: str = "debug"
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment for SLURM clients talking to this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.root / "slurm.conf")
        return env

    def run(
        self, argv: Sequence[str], timeout: float = 60, check: bool = True, **kw: object
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(argv),
            env=kw.pop("env", self.env),  # type: ignore[arg-type]
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            **kw,  # type: ignore[arg-type]
        )

    def job_fields(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``ExitCode``, ``StdOut``, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, timeout: float) -> str:
        """Wait until the job ends (bounded); return its final state."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_fields(job_id).get("JobState", "")
            if state in FINAL_STATES:
                return state
            time.sleep(1)
        self.run(["scancel", job_id], check=False)
        raise TimeoutError(f"SLURM job {job_id} still {state or 'unknown'} after {timeout:.0f} s")

    def completion_log(self) -> str:
        """The jobcomp/filetxt log: one line per finished job with its JobState."""
        path = self.root / "jobcomp.txt"
        return path.read_text() if path.exists() else ""

    def logs(self) -> str:
        """The daemons' logs, for a failure message."""
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name} ---\n" + path.read_text()[-3000:])
        return "\n".join(parts)


def _node_line(hostname: str) -> str:
    """The node as ``slurmd -C`` sees it (CPUs, sockets, memory), so slurmd registers cleanly."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    first = out.splitlines()[0] if out else f"NodeName={hostname} CPUs=2"
    line = re.sub(r"NodeName=\S+", f"NodeName={hostname}", first)
    # A little less memory than measured: slurmd drains a node that reports less than configured.
    mem = re.search(r"RealMemory=(\d+)", line)
    if mem:
        line = line.replace(mem.group(0), f"RealMemory={int(mem.group(1)) // 2}")
    # Addresses by IP: the test machine's hostname need not resolve (containers, CI runners).
    return line + " NodeAddr=127.0.0.1 State=UNKNOWN"


def write_config(root: Path, hostname: str, partition: str = "debug") -> None:
    """slurm.conf and cgroup.conf for one node named ``hostname`` with all state under root."""
    r = root
    conf = f"""\
ClusterName=meshrun-test
SlurmctldHost={hostname}
SlurmctldAddr=127.0.0.1
SlurmUser=root
SlurmdUser=root
SlurmctldPort={free_port("")}
SlurmdPort={free_port("")}
AuthType=auth/munge
# cred_expire: SLURM holds a requeued job this long (+1 s) before it may start again
# (default 120 s); a start before the revoked credential expires fails.
AuthInfo=socket={r}/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# Look at the queue every 2 s (default 60): a requeued job starts soon after its begin time.
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={r}/jobcomp.txt
MinJobAge=3600
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=30
{_node_line(hostname)}
PartitionName={partition} Nodes={hostname} Default=YES MaxTime=INFINITE State=UP
"""
    (r / "slurm.conf").write_text(conf)
    (r / "cgroup.conf").write_text("CgroupAutomount=no\nConstrainCores=no\n")
    for d in ("state", "spool"):
        (r / d).mkdir(exist_ok=True)


def _start(argv: list[str], root: Path, name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    out = open(root / f"{name}.out", "wb")  # noqa: SIM115 - kept open for the daemon's life
    return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root)


def _start_munge(root: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    argv = [
        "munged",
        "--foreground",
        "--force",  # it refuses to run as root otherwise
        f"--socket={root}/munge.socket",
        f"--key-file={key}",
        f"--pid-file={root}/munged.pid",
        f"--log-file={root}/munged.log",
        f"--seed-file={root}/munged.seed",
    ]
    proc = _start(argv, root, "munged", env)
    wait_for(lambda: (root / "munge.socket").exists(), 20, "munged's socket", root)
    return proc


def wait_for(ok: object, timeout: float, what: str, root: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():  # type: ignore[operator]
            return
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready after {timeout:.0f} s; logs in {root}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def node_idle(s: Slurm) -> bool:
    r = s.run(["sinfo", "-h", "-N", "-o", "%T"], check=False, timeout=20)
    return r.returncode == 0 and r.stdout.strip().rstrip("*") == "idle"


@contextmanager
def cluster(start_timeout: float = 60) -> Iterator[Slurm]:
    """Start munged, slurmctld and slurmd on a private config; stop and remove all on exit."""
    require()
    root = Path(tempfile.mkdtemp(prefix="meshrun-slurm-"))
    root.chmod(0o755)  # munged checks that its directories are not writable by others
    s = Slurm(root=root, hostname=socket.gethostname())
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        write_config(root, s.hostname, s.partition)
        env = s.env
        munge = _start_munge(root, env)
        stack.callback(_stop, munge)
        for argv in (["slurmctld", "-D", "-i"], ["slurmd", "-D"]):
            proc = _start(argv, root, argv[0], env)
            stack.callback(_stop, proc)
            s.procs.append(proc)
        try:
            wait_for(lambda: node_idle(s), start_timeout, "the SLURM node (sinfo: idle)", root)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{s.logs()}") from None
        stack.callback(_cancel_all, s)  # runs first: jobs end before the daemons stop
        yield s


@pytest.fixture(scope="session", name="cluster")
def slurm_cluster() -> Iterator[Slurm]:
    """The cluster for a whole test session (fixture name ``cluster``; starts in ~2 s)."""
    with cluster() as s:
        yield s


def _cancel_all(s: Slurm) -> None:
    """Cancel what a (failed) test left running and wait, bounded, for it to be gone, so that
    slurmd has stopped every job step before it is stopped itself."""
    s.run(["scancel", "--user=root"], check=False, timeout=20)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = s.run(["squeue", "-h", "-t", "RUNNING,COMPLETING"], check=False, timeout=20)
        if r.returncode != 0 or not r.stdout.strip():
            return
        time.sleep(0.5)
