"""How was this process started? TorchElastic (torchrun), SLURM srun, MPI, or plain Python.

Each detector reads only environment variables, so this module is pure and unit-tested by
passing a dict (the one exception, rank 0's address of an MPI job asked of MPI itself, lives
in runtime/mpi_rendezvous.py and runs only on this process's own environment). The runtime
turns the result into ``MASTER_ADDR``/``RANK``/... for ``env://``.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass


class LauncherEnvError(RuntimeError):
    """The environment describes a job that cannot be started (names the variable to set)."""


@dataclass(frozen=True)
class LauncherEnv:
    """This process's place in its job as its launcher wrote it in the environment (named for
    the launcher, not a cluster: SLURM's and Ray's clusters are other things)."""

    kind: str  # "torchelastic" | "slurm" | "mpi" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    hostname: str

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.kind == "torchelastic"


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LauncherEnvError(
            f"environment variable {name}={env[name]!r} is not an integer"
        ) from None


def expand_hostlist(spec: str) -> list[str]:
    """Expand a SLURM hostlist such as ``gpu[01-03,07],login1`` into host names."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", spec):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
                continue
            width = len(lo)  # zero padding is kept: node[01-03] -> node01
            hosts.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
    return hosts


def derived_port(job_id: str) -> int:
    """A port derived from a job id so every process of a job agrees without talking."""
    return 20000 + zlib.crc32(job_id.encode()) % 20000


def slurm_port(job_id: str) -> int:
    return derived_port(job_id)


def _from_torchelastic(env: Mapping[str, str], host: str) -> LauncherEnv:
    return LauncherEnv(
        kind="torchelastic",
        rank=_int(env, "RANK"),
        world_size=_int(env, "WORLD_SIZE"),
        local_rank=_int(env, "LOCAL_RANK"),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        node_rank=int(env.get("GROUP_RANK", "0")),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        hostname=host,
    )


def _from_slurm(env: Mapping[str, str], host: str) -> LauncherEnv:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    hosts = expand_hostlist(nodelist)
    if not hosts and "MASTER_ADDR" not in env:
        raise LauncherEnvError("SLURM job without SLURM_JOB_NODELIST: set MASTER_ADDR")
    ntasks = _int(env, "SLURM_NTASKS")
    nnodes = int(env.get("SLURM_NNODES", "1"))
    return LauncherEnv(
        kind="slurm",
        rank=_int(env, "SLURM_PROCID"),
        world_size=ntasks,
        local_rank=_int(env, "SLURM_LOCALID"),
        local_world_size=max(1, ntasks // max(1, nnodes)),
        node_rank=int(env.get("SLURM_NODEID", "0")),
        master_addr=env.get("MASTER_ADDR") or hosts[0],
        master_port=int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0"))),
        hostname=host,
    )


# (rank, size, local rank, local size) variable names of the MPI launchers we recognise.
_MPI_VARS = {
    "Open MPI": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "MPICH": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "PMIx": ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
}
# How each launcher passes a variable to every process, for the error that asks for one.
_PASS_VARS = {
    "Open MPI": "mpirun -x MASTER_ADDR=<address of rank 0's host> -x MASTER_PORT=29500",
    "MPICH": "mpiexec -genv MASTER_ADDR <address of rank 0's host> -genv MASTER_PORT 29500",
    "PMIx": "export MASTER_ADDR=<address of rank 0's host> MASTER_PORT=29500 to every process",
}
_PASS_PORT = {
    "Open MPI": "mpirun -x MASTER_PORT=29500",
    "MPICH": "mpiexec -genv MASTER_PORT 29500",
    "PMIx": "export MASTER_PORT=29500 to every process",
}
# Variables only an MPI launcher's own daemons set, never srun: a process holding them was
# started by mpirun/mpiexec, also inside a SLURM allocation, whose SLURM_PROCID/SLURM_NTASKS
# then describe the batch shell or the launcher's daemon step, not this process (printed from
# a real job: under mpirun -np 2 in an sbatch script of --ntasks-per-node=2 both ranks see
# SLURM_PROCID=0 and SLURM_NTASKS=2). srun --mpi=pmi2/pmix sets PMI_RANK/PMIX_RANK itself, equal
# to SLURM_PROCID: there SLURM's variables are right and need no mpi4py.
_MPI_OWN_VARS = {"Open MPI": "OMPI_COMM_WORLD_RANK", "MPICH": "MPI_LOCALRANKID"}
# A job id every process of one MPI job sees (Open MPI 4; PMIx, also Open MPI 5): the port
# of a one-host job is derived from it, as SLURM's from SLURM_JOB_ID. MPICH's Hydra sets none.
MPI_JOB_ID_VARS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")


def derive_mpi_master(env: Mapping[str, str], launcher: str) -> tuple[str, int] | None:
    """Rank 0's endpoint from the launcher's variables alone, where they imply one: every
    rank on this host (local size == world size) -> loopback, the port from MASTER_PORT or
    the job id. None when they do not (many hosts, or no job id)."""
    _, size_v, _, lsize_v = _MPI_VARS[launcher]
    if lsize_v not in env or _int(env, lsize_v) != _int(env, size_v):
        return None
    if "MASTER_PORT" in env:
        return "127.0.0.1", _int(env, "MASTER_PORT")
    job = next((env[v] for v in MPI_JOB_ID_VARS if env.get(v)), None)
    return None if job is None else ("127.0.0.1", derived_port(job))


def mpi_master_error(
    env: Mapping[str, str], launcher: str, why_not_mpi4py: str
) -> LauncherEnvError:
    rank_v, size_v, _, lsize_v = _MPI_VARS[launcher]
    world, local = env[size_v], env.get(lsize_v, "unset")
    mpi4py = f"mpi4py could not help ({why_not_mpi4py}); " if why_not_mpi4py else ""
    started = f"started by {launcher}'s launcher ({rank_v} is set) with {size_v}={world}"
    if local == world:  # one host: only the port is missing (MPICH's Hydra sets no job id)
        return LauncherEnvError(
            f"{started} processes, all on this host (rank 0 at 127.0.0.1), but no port: "
            f"{mpi4py}{launcher} sets no job id ({' or '.join(MPI_JOB_ID_VARS)}) to derive "
            f"one from. Install mpi4py (pip install 'meshrun[mpi]'), or pass a free port: "
            f"{_PASS_PORT[launcher]}"
        )
    return LauncherEnvError(
        f"{started} processes ({lsize_v}={local} on this host), but nothing says where rank 0 "
        f"listens: {mpi4py}the launcher's variables give an address only when every rank is "
        "on one host. Install mpi4py (pip install 'meshrun[mpi]') to let meshrun find it, or "
        f"pass it to every process: {_PASS_VARS[launcher]}"
    )


def _mpi_master(env: Mapping[str, str], launcher: str, live: bool) -> tuple[str, int]:
    world = _int(env, _MPI_VARS[launcher][1])
    if "MASTER_ADDR" in env or world == 1:
        return env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))
    if live:
        return _ask_mpi(env, launcher, world)
    derived = derive_mpi_master(env, launcher)
    if derived is None:
        raise mpi_master_error(env, launcher, "")
    return derived


def _ask_mpi(env: Mapping[str, str], launcher: str, world: int) -> tuple[str, int]:
    """Over MPI itself (mpi4py), else the launcher's variables with a printed line saying so,
    else the error. The one impure step of detection, for this process's own environment."""
    from meshrun.runtime.mpi_rendezvous import MpiRendezvousError, find_endpoint

    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else 0
    try:
        found, why = find_endpoint(world, launcher, _MPI_VARS[launcher][1], port)
    except MpiRendezvousError as err:
        raise LauncherEnvError(str(err)) from None
    if found is not None:
        return found.addr, found.port
    derived = derive_mpi_master(env, launcher)
    if derived is None:
        raise mpi_master_error(env, launcher, why)
    if env.get(_MPI_VARS[launcher][0]) == "0":
        port_from = "MASTER_PORT" if "MASTER_PORT" in env else "the job id"
        print(
            f"meshrun: mpi: every rank on this host: rank 0 at {derived[0]}:{derived[1]} "
            f"(port from {port_from}); mpi4py did not import ({why})",
            file=sys.stderr,
            flush=True,
        )
    return derived


def _from_mpi(env: Mapping[str, str], host: str, launcher: str, live: bool) -> LauncherEnv:
    rank_v, size_v, lrank_v, lsize_v = _MPI_VARS[launcher]
    world = _int(env, size_v)
    local_world = _int(env, lsize_v) if lsize_v in env else 1
    rank = _int(env, rank_v)
    addr, port = _mpi_master(env, launcher, live)
    return LauncherEnv(
        kind="mpi",
        rank=rank,
        world_size=world,
        local_rank=_int(env, lrank_v) if lrank_v in env else 0,
        local_world_size=local_world,
        node_rank=rank // max(1, local_world),
        master_addr=addr,
        master_port=port,
        hostname=host,
    )


def detect(env: Mapping[str, str] | None = None) -> LauncherEnv:
    """Detect the launcher from the environment; the first match wins (torchrun inside srun
    is torchrun).

    With no ``env`` (this process's own environment) an MPI job without ``MASTER_ADDR``
    asks MPI where rank 0 listens (mpi4py, :mod:`meshrun.runtime.mpi_rendezvous`); a given mapping is read
    and nothing else (the launcher's variables, or an error naming what to set)."""
    live = env is None
    env = os.environ if env is None else env
    host = socket.gethostname()
    if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return _from_torchelastic(env, host)
    launcher = _mpi_launcher(env)
    if launcher and _MPI_OWN_VARS.get(launcher, "") in env:  # mpirun inside SLURM too
        return _from_mpi(env, host, launcher, live)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and _int(env, "SLURM_NTASKS") > 1:
        return _from_slurm(env, host)
    if launcher:
        return _from_mpi(env, host, launcher, live)
    return LauncherEnv("single", 0, 1, 0, 1, 0, "127.0.0.1", 0, host)


def _mpi_launcher(env: Mapping[str, str]) -> str:
    """The MPI launcher whose rank and size variables are set ("" for none)."""
    names = (name for name, (rank, size, _, _) in _MPI_VARS.items() if rank in env and size in env)
    return next(names, "")
