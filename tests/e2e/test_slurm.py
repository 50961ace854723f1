"""SLURM for real: a one-node cluster from Debian's slurm-wlm and munge (tests/slurm.py)
runs what ``meshrun slurm submit`` writes, and ``meshrun launch`` inside ``srun``.

Needs root and the binaries (skips otherwise; CI has both). The cluster lives for the session
and is stopped, its jobs cancelled and its files removed afterwards, also on failure. Jobs are
checked with ``scontrol show job`` and the jobcomp/filetxt log: SLURM 22.05 has no file-based
accounting storage, so ``sacct`` has nothing to read without slurmdbd.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurm
from meshrun.runtime.launcher_env import slurm_port

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).parent / "scripts"
# The demo at its smallest: a 200 kB corpus prepares in well under a second.
LAUNCH = [sys.executable, "-m", "meshrun", "launch"]
DEMO = ["-m", "meshrun.demo", "--corpus-bytes", "200000", "--metrics.progress=false"]


cluster = slurm.slurm_cluster  # the session's one-node SLURM (started once, stopped at the end)


def _submit(s: slurm.Slurm, *argv: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    """``meshrun slurm submit ARGV``; returns the job id and the printed line."""
    r = subprocess.run(
        [sys.executable, "-m", "meshrun", "slurm", "submit", *argv],
        env=s.env if env is None else env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    m = re.search(r"submitted job (\d+)", r.stdout)
    assert m, r.stdout
    return m.group(1), r.stdout


def _node_out(run_dir: Path, job: str) -> str:
    files = sorted((run_dir / "slurm").glob(f"*-{job}-node*.out"))
    return "\n".join(f.read_text(errors="replace") for f in files)


def _direct_launcher_or_skip(s: slurm.Slurm, launcher: str) -> dict[str, str]:
    """The extra environment a job of ``--launcher LAUNCHER`` needs here, or skip."""
    if launcher == "mpirun":
        if shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None:
            pytest.skip("mpirun (Debian: openmpi-bin) or mpi4py (the mpi extra) not installed")
        # sbatch passes the submitter's environment; Open MPI refuses root without these.
        return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    probe = s.run(["srun", "-N1", "--mpi=pmix", "true"], check=False, timeout=60)
    if probe.returncode != 0:  # SLURM's pmix plugin loads libpmix.so at run time
        pytest.skip(f"srun --mpi=pmix fails here (Debian: libpmix-dev): {probe.stderr[-300:]}")
    return {}


# heavy: [mpirun]; [srun] stays, and Open MPI's ranks and mpi4py endpoint run in test_mpirun.py
@pytest.mark.parametrize("launcher", [pytest.param("mpirun", marks=pytest.mark.heavy), "srun"])
@pytest.mark.timeout(200)
def test_submitted_demo_under_a_direct_launcher(
    cluster: slurm.Slurm, tmp_path: Path, launcher: str
) -> None:
    """``--launcher mpirun|srun``: one SLURM task per worker, no meshrun launch or torchrun;
    meshrun.init() takes the ranks from Open MPI's variables (rank 0's endpoint over mpi4py)
    or from SLURM's, never from the batch shell's SLURM_PROCID, and trains to the end."""
    extra = _direct_launcher_or_skip(cluster, launcher)
    run_dir = tmp_path / "run"
    job, line = _submit(
        cluster,
        *("--launcher", launcher, "--nodes", "1", "--nproc-per-node", "2", "--time", "10"),
        *("--set", "checkpoint.interval=2"),  # reaches the workers through the config file
        *DEMO,
        *("--size", "tiny", "--steps", "4", f"--job.run_dir={run_dir}"),
        env={**cluster.env, **extra},
    )
    state = cluster.wait_job(job, timeout=180)
    batch_out = (run_dir / "slurm" / f"meshrun-run-{job}.out").read_text(errors="replace")
    out = batch_out + _node_out(run_dir, job)
    assert state == "COMPLETED", f"{state}\n{out}\n{cluster.logs()}"
    script = (run_dir / "slurm" / "job.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --cpus-per-task=1" in script
    assert "meshrun launch" not in script
    assert "checkpoint.interval=2" not in script  # in the resolved config, not the command
    resolved = (run_dir / "slurm" / "config.toml").read_text()
    assert re.search(r"\[checkpoint\][^[]*\ninterval = 2\n", resolved), resolved
    if launcher == "mpirun":
        assert "(batch script and every rank)" in line
        assert "meshrun: mpi: rank 0 listens on 127.0.0.1:" in out, out
        assert "(found over mpi4py, Open MPI" in out
    assert f"2 process(es) [{'mpi' if launcher == 'mpirun' else 'slurm'}]" in out, out
    assert "step 4/4" in out, out
    # interval 2 from --set: a checkpoint at step 2 as well as the final one
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()
    assert (run_dir / "checkpoints" / "step_00000004").is_dir()
    assert f"job {job} finished with exit code 0" in batch_out


def _topologies(text: str) -> list[dict[str, str]]:
    """The workers' ``TOPOLOGY`` objects (scripts/print_topology.py), one per match: a flat
    object never holds a brace, so two objects that share a line stay two."""
    return [json.loads(m) for m in re.findall(r"TOPOLOGY (\{[^{}]*\})", text)]


def _srun(s: slurm.Slurm, argv: list[str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return s.run(["srun", "-N1", *argv], timeout=timeout, check=False)


@pytest.mark.timeout(150)
def test_launch_in_allocation_derives_srun_topology(cluster: slurm.Slurm, tmp_path: Path) -> None:
    # srun's own view and meshrun launch's, in the same task.
    shell = (
        'echo "SRUN nnodes=$SLURM_NNODES nodeid=$SLURM_NODEID '
        'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1)"; '
        f"exec {sys.executable} -m meshrun launch {SCRIPTS / 'print_topology.py'} "
        f"--job.run_dir={tmp_path}"
    )
    r = _srun(cluster, ["--ntasks-per-node=1", "--cpus-per-task=2", "bash", "-c", shell])
    text = r.stdout + r.stderr
    assert r.returncode == 0, text
    srun_line = re.search(r"SRUN (.*)", text)
    assert srun_line, text
    srun = dict(re.findall(r"(\w+)=(\S+)", srun_line.group(1)))
    derived = re.search(
        r"SLURM job \d+: nnodes (\d+) .*node_rank (\d+) .*nproc_per_node (\d+)"
        r" \(no GPUs: CPU default\), master (\S+)",
        text,
    )
    assert derived, text
    nnodes, node_rank, nproc, master = derived.groups()
    assert (nnodes, node_rank, master) == (srun["nnodes"], srun["nodeid"], srun["first"])
    assert master == cluster.hostname
    workers = _topologies(text)
    assert sorted(w["RANK"] for w in workers) == ["0", "1"]
    for w in workers:
        assert w["WORLD_SIZE"] == str(int(nnodes) * int(nproc)) == "2"
        assert w["GROUP_RANK"] == node_rank and w["LOCAL_WORLD_SIZE"] == nproc


@pytest.mark.timeout(120)
def test_launch_in_allocation_rejects_a_mismatch(cluster: slurm.Slurm, tmp_path: Path) -> None:
    launch = [sys.executable, "-m", "meshrun", "launch", str(SCRIPTS / "print_topology.py")]
    # Two tasks on the node would each start their own launcher: refused before any spawn.
    r = _srun(cluster, ["--ntasks-per-node=2", *launch, f"--job.run_dir={tmp_path}"])
    assert r.returncode != 0
    assert r.stderr.count("SLURM_STEP_TASKS_PER_NODE=2") == 2, r.stderr
    assert "srun --ntasks-per-node=1" in r.stderr and "TOPOLOGY" not in r.stdout
    # One CPU for two processes: the fix names --cpus-per-task.
    r = _srun(
        cluster,
        [
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            *launch[:4],
            "--nproc-per-node",
            "2",
            *launch[4:],
            f"--job.run_dir={tmp_path}",
        ],
    )
    assert r.returncode != 0
    assert "SLURM_CPUS_ON_NODE=1" in r.stderr and "--cpus-per-task=2" in r.stderr, r.stderr


@pytest.mark.timeout(200)
def test_submitted_demo_checkpoints_at_the_time_limit_signal_requeues_and_completes(
    cluster: slurm.Slurm, tmp_path: Path
) -> None:
    """``meshrun slurm submit`` of the demo, 2 workers on 1 node: SLURM's pre-time-limit USR1
    (sent here at once with ``scancel --batch --signal``, which is what ``--signal=B:USR1@S``
    does at the limit): the workers save and exit 0, the batch script requeues the job, and the
    second start resumes from that checkpoint to the end; the job then ends COMPLETED with exit
    code 0 (one launch shows the plain submission too)."""
    run_dir = tmp_path / "run"
    steps = 40
    job, line = _submit(
        cluster,
        *("--nodes", "1", "--nproc-per-node", "2", "--time", "10", "--requeue"),
        *DEMO,
        *("--size", "tiny", "--steps", str(steps), f"--job.run_dir={run_dir}"),
        "--checkpoint.interval=1000",  # > steps: the only save before the end is the signal's
    )
    # Step 2: the handler is installed after step 1 (at its first checkpoint decision).
    _wait_for_text(cluster, run_dir, job, r"step +2/", timeout=90)
    cluster.run(["scancel", "--batch", "--signal=USR1", job])
    # Requeued, it starts again after cred_expire (5 s in tests/slurm.py, 120 s by default).
    state = cluster.wait_job(job, timeout=150)
    out = _node_out(run_dir, job)
    batch_out = (run_dir / "slurm" / f"meshrun-run-{job}.out").read_text()
    assert state == "COMPLETED", f"{state}\n{batch_out}\n{out}\n{cluster.logs()}"
    assert cluster.job_fields(job)["Restarts"] == "1"
    assert "SIGUSR1 from SLURM" in batch_out and f"requeueing job {job}" in batch_out
    saved = re.search(r"preempted \(SIGUSR1\): checkpoint \S+step_0*(\d+) written", out)
    assert saved, out
    assert 1 <= int(saved.group(1)) < steps
    assert re.search(rf"resumed from \S+step_0*{saved.group(1)} \(step {saved.group(1)},", out)
    assert f"step {steps}/{steps}" in out
    assert (run_dir / "checkpoints" / f"step_{steps:08d}").is_dir()
    fields = cluster.job_fields(job)
    assert fields["ExitCode"] == "0:0" and fields["NumNodes"] == "1"
    assert re.search(rf"JobId={job} .*JobState=COMPLETED", cluster.completion_log())
    # The script was saved next to the run, with one task per node and the signal.
    script = (run_dir / "slurm" / "job.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in script and "--signal=B:USR1@120" in script
    assert str(run_dir / "slurm") in line
    assert "2 processes x 1 node" in out
    # The batch step's job secret reached the node's launch through srun's environment (it
    # wins over RUN_DIR/job.secret, which the launch would otherwise have written).
    assert not (run_dir / "job.secret").exists()
    assert f"job {job} finished with exit code 0" in batch_out


def _wait_for_text(s: slurm.Slurm, run_dir: Path, job: str, pattern: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, _node_out(run_dir, job)):
            return
        time.sleep(0.2)
    raise TimeoutError(
        f"{pattern!r} not in job {job}'s output after {timeout} s: {s.job_fields(job)}\n"
        + _node_out(run_dir, job)
    )


@pytest.mark.timeout(150)
def test_two_node_allocation_over_namespaces(tmp_path: Path) -> None:
    """Two hosts (network namespaces, tests/netns.py) with the variables ``srun -N2
    --ntasks-per-node=1`` sets, and no topology flag: each ``meshrun launch`` derives its
    rank and the first node's address and port, and the two form one 4-process job.
    (SLURM itself runs one node here: Debian's slurmd cannot play two.)"""
    import netns

    with netns.hosts(2) as net:
        hosts = f"{net.address(0)},{net.address(1)}"  # addresses: namespace names do not resolve
        procs = []
        try:
            for i in (1, 0):
                env = {**_plain_env(), **_srun_vars(hosts, node_id=i)}
                script = [str(SCRIPTS / "print_topology.py"), f"--job.run_dir={tmp_path}/run"]
                argv = [*LAUNCH, "--join-timeout", "90", *script]
                procs.append(
                    subprocess.Popen(
                        net.argv(i, argv),
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                        start_new_session=True,
                    )
                )
            outs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.communicate()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    port = slurm_port("77")
    for i, out in zip((1, 0), outs, strict=True):
        assert f"nnodes 2 (SLURM_STEP_NUM_NODES=2), node_rank {i} (SLURM_NODEID={i})" in out
        assert f"master {net.address(0)}" in out and f"rendezvous {net.address(0)}:{port}" in out
        workers = _topologies(out)
        assert len(workers) == 2, out[-3000:]
        for w in workers:
            assert (w["WORLD_SIZE"], w["GROUP_RANK"], w["LOCAL_WORLD_SIZE"]) == ("4", str(i), "2")


def _plain_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "SLURM_CONF"):
        env.pop(var, None)
    return env


def _srun_vars(hosts: str, node_id: int) -> dict[str, str]:
    """What ``srun -N2 --ntasks-per-node=1 --cpus-per-task=2`` sets in task ``node_id``."""
    return {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NNODES": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_NODEID": str(node_id),
        "SLURM_PROCID": str(node_id),
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": hosts,
        "SLURM_STEP_NODELIST": hosts,
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_CPUS_ON_NODE": "2",
    }
