"""How was this process started? TorchElastic (torchrun), SLURM srun, MPI, or plain Python.

Each detector reads only environment variables, so this module is pure and unit-tested by
passing a dict. The runtime turns the result into ``MASTER_ADDR``/``RANK``/... for ``env://``.
"""

from __future__ import annotations

import os
import re
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass


class ClusterError(RuntimeError):
    """The environment describes a job that cannot be started (names the variable to set)."""


@dataclass(frozen=True)
class ClusterEnv:
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
        raise ClusterError(f"environment variable {name}={env[name]!r} is not an integer") from None


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


def slurm_port(job_id: str) -> int:
    """A port derived from the job id so every task of a job agrees without talking."""
    return 20000 + zlib.crc32(job_id.encode()) % 20000


def _from_torchelastic(env: Mapping[str, str], host: str) -> ClusterEnv:
    return ClusterEnv(
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


def _from_slurm(env: Mapping[str, str], host: str) -> ClusterEnv:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    hosts = expand_hostlist(nodelist)
    if not hosts and "MASTER_ADDR" not in env:
        raise ClusterError("SLURM job without SLURM_JOB_NODELIST: set MASTER_ADDR")
    ntasks = _int(env, "SLURM_NTASKS")
    nnodes = int(env.get("SLURM_NNODES", "1"))
    return ClusterEnv(
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
    "MPICH/PMI": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "PMIx": ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
}


def _from_mpi(env: Mapping[str, str], host: str, names: tuple[str, str, str, str]) -> ClusterEnv:
    rank_v, size_v, lrank_v, lsize_v = names
    world = _int(env, size_v)
    if world > 1 and "MASTER_ADDR" not in env:
        raise ClusterError(
            f"started by an MPI launcher ({rank_v} is set) with {world} processes, but MPI does "
            "not say where rank 0 listens: export MASTER_ADDR=<host of rank 0> (and MASTER_PORT) "
            "to every process, e.g. mpirun -x MASTER_ADDR=node01 -x MASTER_PORT=29500"
        )
    local_world = int(env.get(lsize_v, "1"))
    rank = _int(env, rank_v)
    return ClusterEnv(
        kind="mpi",
        rank=rank,
        world_size=world,
        local_rank=int(env.get(lrank_v, "0")),
        local_world_size=local_world,
        node_rank=rank // max(1, local_world),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        hostname=host,
    )


def detect(env: Mapping[str, str] | None = None) -> ClusterEnv:
    """Detect the launcher from the environment; the first match wins (torchrun inside srun
    is torchrun)."""
    env = os.environ if env is None else env
    host = socket.gethostname()
    if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return _from_torchelastic(env, host)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and _int(env, "SLURM_NTASKS") > 1:
        return _from_slurm(env, host)
    for names in _MPI_VARS.values():
        if names[0] in env and names[1] in env:
            return _from_mpi(env, host, names)
    return ClusterEnv("single", 0, 1, 0, 1, 0, "127.0.0.1", 0, host)
