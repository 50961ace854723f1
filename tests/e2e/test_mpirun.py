"""``mpirun`` (Open MPI) and ``mpiexec.mpich`` (MPICH) start a meshrun script unchanged, with no
MASTER_ADDR: the demo trains with the same per-step losses as under ``meshrun launch``, on one
host and on two network-namespace hosts (tests/netns.py; Open MPI starts the remote rank over
ssh, tests/sshd.py). mpi4py imports here (meshrun's ``mpi`` extra): meshrun asks MPI for rank
0's endpoint; hidden, meshrun derives it on one host and stops with the flags to pass across
hosts; bound to another MPI than the launcher's, it stops with the fix (docs/mpirun.md).

Cost: one reference ``meshrun launch`` and one launch of the 8-step tiny demo per launcher
(Open MPI one host, MPICH one host, Open MPI two hosts, MPICH two hosts), plus three short launches of a script that
only initialises and all-reduces or only detects (the error paths). Skips when a launcher is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import netns
import sshd

pytestmark = pytest.mark.slow
PY = sys.executable
ALLREDUCE = str(Path(__file__).parent / "scripts" / "mpi_meshrun_allreduce.py")
DETECT = str(Path(__file__).parent / "scripts" / "mpi_detect.py")  # no torch: the error paths
DEMO = ["-m", "meshrun.demo", "--steps", "8", "--size", "tiny", "--corpus-bytes", "300000"]
LAUNCH_TIMEOUT_S = 300
# Open MPI refuses root without these (tests run as root in containers); see docs/mpirun.md.
ROOT_OK = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _require(tool: str, package: str) -> None:
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (Debian: {package})")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install -e '.[mpi]')")


def _env(**extra: str) -> dict[str, str]:
    drop = ("MASTER_ADDR", "MASTER_PORT", "MESHRUN_CONFIG", "PYTHONPATH", "LD_LIBRARY_PATH")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("MPI4PY_")}
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(var, None)  # the test is about meshrun choosing them
    return {**env, "OMP_NUM_THREADS": "1", "COLUMNS": "100", **ROOT_OK, **extra}


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )


def _ok(p: subprocess.CompletedProcess[str]) -> str:
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"exit {p.returncode}\n{out[-4000:]}"
    return out


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    return [r["loss"] for r in steps]


def _hide_mpi4py(tmp: Path) -> str:
    """A directory that, first on PYTHONPATH, makes ``import mpi4py`` fail."""
    (tmp / "hide" / "mpi4py").mkdir(parents=True)
    (tmp / "hide" / "mpi4py" / "__init__.py").write_text('raise ImportError("hidden by test")\n')
    return str(tmp / "hide")


def _default_mpi4py_library() -> str:
    probe = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
    p = subprocess.run([PY, "-c", probe], env=_env(), capture_output=True, text=True, timeout=60)
    return p.stdout.strip()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The demo's per-step losses under ``meshrun launch --nproc-per-node 2``."""
    tmp = tmp_path_factory.mktemp("reference")
    argv = [PY, "-m", "meshrun", "launch", "--nproc-per-node", "2", *DEMO, "--run-dir", "ref"]
    _ok(_run(argv, _env(), tmp))
    return _losses(tmp / "ref")


# --- one host ------------------------------------------------------------------------------


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
def test_mpirun_trains_like_meshrun_launch(reference: list[float], tmp_path: Path) -> None:
    _require("mpirun", "openmpi-bin")
    out = _ok(_run(["mpirun", "-np", "2", PY, *DEMO, "--run-dir", "run"], _env(), tmp_path))
    assert "meshrun: mpi: rank 0 listens on 127.0.0.1:" in out
    assert "(found over mpi4py, Open MPI" in out
    assert "2 process(es) [mpi]" in out
    assert _losses(tmp_path / "run") == reference  # bitwise: same world, same config

    # Without mpi4py, on one host: loopback and a port from Open MPI's job id, said so.
    env = _env(PYTHONPATH=_hide_mpi4py(tmp_path))
    out = _ok(_run(["mpirun", "-np", "2", PY, ALLREDUCE, "--job.run_dir=ar"], env, tmp_path))
    assert "meshrun: mpi: every rank on this host: rank 0 at 127.0.0.1:" in out
    assert (
        "(port from the job id); mpi4py did not import (ImportError: hidden by test; set "
        "MPI4PY_MPIABI=openmpi, the launcher's)" in out
    )
    for rank in (0, 1):
        assert f"rank {rank} of 2 [mpi] master 127.0.0.1:" in out
        assert f"local {rank}/2 sum 3" in out


def _mpich_abi_dir(tmp: Path) -> dict[str, str]:
    """The environment that points mpi4py at MPICH: MPI4PY_MPIABI=mpich and MPICH's library
    under the name the wheel links (libmpi.so.12; Debian ships it as libmpich.so.12)."""
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    found = [
        line.split("=>")[-1].strip() for line in listing.splitlines() if "libmpich.so.12" in line
    ]
    if not found:
        pytest.skip("MPICH's libmpich.so.12 is not in the loader cache (Debian: libmpich12)")
    (tmp / "mpich-abi").mkdir()
    (tmp / "mpich-abi" / "libmpi.so.12").symlink_to(found[0])
    return {"MPI4PY_MPIABI": "mpich", "LD_LIBRARY_PATH": str(tmp / "mpich-abi")}


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
def test_mpich_trains_like_meshrun_launch(reference: list[float], tmp_path: Path) -> None:
    _require("mpiexec.mpich", "mpich")
    mpiexec = ["mpiexec.mpich", "-n", "2", PY]
    if "Open MPI" in _default_mpi4py_library():
        # mpi4py bound to Open MPI sees each MPICH process alone: named, with the fix.
        p = _run([*mpiexec, DETECT], _env(), tmp_path)
        assert p.returncode != 0
        assert "started by MPICH's launcher as one of PMI_SIZE=2, but mpi4py runs Open MPI" in (
            p.stderr
        )
        assert "Fix: point mpi4py at MPICH: MPI4PY_MPIABI=mpich" in p.stderr
    env = _env(**_mpich_abi_dir(tmp_path))
    out = _ok(_run([*mpiexec, *DEMO, "--run-dir", "run"], env, tmp_path))
    assert "meshrun: mpi: rank 0 listens on 127.0.0.1:" in out
    assert "(found over mpi4py, MPICH" in out
    assert _losses(tmp_path / "run") == reference


# --- two hosts -----------------------------------------------------------------------------


# heavy (CI's time): mpirun on one host stays in CI (test_mpirun_trains_like_meshrun_launch);
# hosts in namespaces in test_hostfile.py
@pytest.mark.heavy
@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
def test_mpirun_across_two_hosts(reference: list[float], tmp_path: Path) -> None:
    """mpirun in host 0 starts rank 0 there and rank 1 on host 1 over ssh (``-H``): rank 0's
    address is host 0's veth, never loopback, and each host's Gloo binds its veth."""
    _require("mpirun", "openmpi-bin")
    netns.require()
    sshd.require()
    with netns.hosts(2) as net, sshd.servers(net, [1], tmp_path / "ssh") as ssh:
        a0, a1 = net.address(0), net.address(1)
        mpirun = ["mpirun", "-np", "2", "-H", f"{a0}:1,{a1}:1"]
        mpirun += ["--mca", "plm_rsh_agent", " ".join(["ssh", *ssh.client_args()])]
        # Open MPI passes a remote rank only the variables named by -x.
        mpirun += ["-x", "OMP_NUM_THREADS", "-x", "COLUMNS"]
        argv = net.argv(0, [*mpirun, PY, *DEMO, "--run-dir", str(tmp_path / "run")])
        out = _ok(_run(argv, _env(), tmp_path))
        assert f"meshrun: mpi: rank 0 listens on {a0}:" in out
        assert f"rank 0 on node0 reaches {a0} through interface eth-mr" in out
        assert f"rank 1 on node1 reaches {a0} through interface eth-mr" in out
        assert _losses(tmp_path / "run") == reference

        # No mpi4py, ranks on two hosts: nothing to derive an address from; the flags to pass.
        hidden = ["-x", f"PYTHONPATH={_hide_mpi4py(tmp_path)}"]
        p = _run(net.argv(0, [*mpirun, *hidden, PY, DETECT]), _env(), tmp_path)
        assert p.returncode != 0
        assert "OMPI_COMM_WORLD_SIZE=2 processes (OMPI_COMM_WORLD_LOCAL_SIZE=1 on" in p.stderr
        assert "mpi4py could not help (ImportError: hidden by test; set MPI4PY_MPIABI" in p.stderr
        assert "mpirun -x MASTER_ADDR=<address of rank 0's host> -x MASTER_PORT=29500" in (p.stderr)


def _ssh_wrapper(path: Path, ssh: sshd.SshSetup) -> str:
    """An executable that runs ssh with the test's client options: Hydra's -launcher-exec
    takes a program, not a command line."""
    path.write_text(f'#!/bin/sh\nexec ssh {" ".join(ssh.client_args())} "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.mark.timeout(3 * LAUNCH_TIMEOUT_S)
# heavy: MPICH on one host stays in CI (test_mpich_trains_like_meshrun_launch)
@pytest.mark.heavy
def test_mpich_across_two_hosts(reference: list[float], tmp_path: Path) -> None:
    """MPICH's Hydra in host 0 starts rank 1 on host 1 over ssh (``-hosts``, ``-launcher
    ssh``); it passes its whole environment, so mpi4py is pointed at MPICH on both hosts by
    the variables given to mpiexec alone. Rank 0 at host 0's veth, both hosts on it."""
    _require("mpiexec.mpich", "mpich")
    netns.require()
    sshd.require()
    env = _env(**_mpich_abi_dir(tmp_path))
    with netns.hosts(2) as net, sshd.servers(net, [1], tmp_path / "ssh") as ssh:
        a0, a1 = net.address(0), net.address(1)
        mpiexec = ["mpiexec.mpich", "-hosts", f"{a0},{a1}", "-n", "2", "-launcher", "ssh"]
        mpiexec += ["-launcher-exec", _ssh_wrapper(tmp_path / "ssh-opts", ssh)]
        argv = net.argv(0, [*mpiexec, PY, *DEMO, "--run-dir", str(tmp_path / "run")])
        out = _ok(_run(argv, env, tmp_path))
        assert f"meshrun: mpi: rank 0 listens on {a0}:" in out
        assert "(found over mpi4py, MPICH" in out
        assert f"rank 0 on node0 reaches {a0} through interface eth-mr" in out
        assert f"rank 1 on node1 reaches {a0} through interface eth-mr" in out
        assert _losses(tmp_path / "run") == reference  # bitwise, as on one host
