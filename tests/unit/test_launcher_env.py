"""Launcher detection from environment dicts: torchrun, SLURM srun, MPI, plain Python."""

from __future__ import annotations

import zlib

import pytest

from meshrun.runtime.launcher_env import (
    LauncherEnvError,
    derived_port,
    detect,
    expand_hostlist,
    slurm_port,
)

pytestmark = pytest.mark.timeout(10)

SLURM_JOB = {
    "SLURM_NTASKS": "8",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_JOB_ID": "4242",
}


def _slurm_task(rank: int) -> dict[str, str]:
    return {
        **SLURM_JOB,
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % 4),
        "SLURM_NODEID": str(rank // 4),
    }


# --- torchelastic ------------------------------------------------------------------------


def test_torchelastic_env() -> None:
    env = {
        "TORCHELASTIC_RUN_ID": "abc",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29555",
    }
    c = detect(env)
    assert c.kind == "torchelastic"
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == (5, 8, 1, 4)
    assert c.node_rank == 1
    assert (c.master_addr, c.master_port) == ("node0", 29555)
    assert c.distributed


def test_torchelastic_env_without_run_id_or_optional_vars() -> None:
    c = detect({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    assert c.kind == "torchelastic"
    assert (c.world_size, c.local_world_size, c.node_rank) == (1, 1, 0)
    assert (c.master_addr, c.master_port) == ("127.0.0.1", 29500)
    assert c.distributed  # a 1-process torchrun job still initialises a process group


def test_a_non_integer_rank_is_an_error_naming_the_variable() -> None:
    with pytest.raises(LauncherEnvError, match="RANK='x'"):
        detect({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_torchrun_inside_srun_is_torchelastic() -> None:
    env = {
        **_slurm_task(4),
        "TORCHELASTIC_RUN_ID": "job",
        "RANK": "3",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "3",
        "MASTER_ADDR": "gpu02",
    }
    c = detect(env)
    assert c.kind == "torchelastic"
    assert (c.rank, c.world_size, c.local_rank) == (3, 16, 3)
    assert c.master_addr == "gpu02"


# --- SLURM -------------------------------------------------------------------------------


def test_slurm_srun_task() -> None:
    c = detect(_slurm_task(5))
    assert c.kind == "slurm"
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == (5, 8, 1, 4)
    assert c.node_rank == 1
    assert c.master_addr == "gpu01"
    assert c.master_port == 20000 + zlib.crc32(b"4242") % 20000
    assert c.distributed


def test_slurm_master_is_the_same_for_every_task() -> None:
    endpoints = {
        (detect(_slurm_task(r)).master_addr, detect(_slurm_task(r)).master_port) for r in range(8)
    }
    assert endpoints == {("gpu01", slurm_port("4242"))}


def test_slurm_port_is_in_range_and_depends_on_the_job() -> None:
    ports = {slurm_port(str(job)) for job in range(1000, 1020)}
    assert all(20000 <= p < 40000 for p in ports)
    assert len(ports) > 1
    assert slurm_port("4242") == slurm_port("4242")


def test_slurm_master_addr_and_port_from_the_env_win() -> None:
    c = detect({**_slurm_task(0), "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (c.master_addr, c.master_port) == ("head", 1234)


def test_slurm_step_nodelist_wins_over_the_job_nodelist() -> None:
    c = detect({**_slurm_task(0), "SLURM_STEP_NODELIST": "gpu[07-08]"})
    assert c.master_addr == "gpu07"


def test_slurm_without_a_nodelist_or_master_addr_is_an_error() -> None:
    env = _slurm_task(0)
    del env["SLURM_JOB_NODELIST"]
    with pytest.raises(LauncherEnvError, match="MASTER_ADDR"):
        detect(env)


def test_slurm_with_one_task_is_single() -> None:
    env = {**_slurm_task(0), "SLURM_NTASKS": "1", "SLURM_NNODES": "1"}
    c = detect(env)
    assert c.kind == "single"
    assert (c.rank, c.world_size) == (0, 1)
    assert not c.distributed


# --- MPI ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "names",
    [
        (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
        ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
    ],
    ids=["openmpi", "mpich", "pmix"],
)
def test_mpi_launchers(names: tuple[str, str, str, str]) -> None:
    rank, size, local_rank, local_size = names
    env = {
        rank: "6",
        size: "8",
        local_rank: "2",
        local_size: "4",
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "29600",
    }
    c = detect(env)
    assert c.kind == "mpi"
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size) == (6, 8, 2, 4)
    assert c.node_rank == 1
    assert (c.master_addr, c.master_port) == ("node01", 29600)
    assert c.distributed


def _ompi(rank: int, size: int, local_size: int, **extra: str) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        **extra,
    }


# The batch shell's SLURM variables, as every process of mpirun/mpiexec in an sbatch script of
# --ntasks-per-node=2 inherits them (printed from a real job): the same for both ranks.
BATCH_SHELL = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}


def test_mpirun_inside_a_slurm_allocation_is_mpi_not_the_batch_shells_task() -> None:
    ranks = {detect({**BATCH_SHELL, **_ompi(r, 2, 2, OMPI_MCA_ess_base_jobid="9")}) for r in (0, 1)}
    assert {(c.kind, c.rank, c.local_rank) for c in ranks} == {("mpi", 0, 0), ("mpi", 1, 1)}
    hydra = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    c = detect({**BATCH_SHELL, **hydra, "MASTER_PORT": "29611"})
    assert (c.kind, c.rank, c.master_addr, c.master_port) == ("mpi", 1, "127.0.0.1", 29611)


def test_srun_with_a_pmi_plugin_stays_slurm() -> None:
    # srun --mpi=pmi2 sets PMI_RANK = SLURM_PROCID but no MPI_LOCALRANKID: SLURM's variables
    # are this process's, and give rank 0's host without mpi4py.
    c = detect({**_slurm_task(5), "PMI_RANK": "5", "PMI_SIZE": "8", "PMIX_RANK": "5"})
    assert (c.kind, c.rank, c.master_addr) == ("slurm", 5, "gpu01")


def test_open_mpi_on_one_host_derives_loopback_and_a_port_from_the_job_id() -> None:
    # What mpirun -np 2 sets on one host (printed from a real run): no MASTER_ADDR.
    found = {detect(_ompi(r, 2, 2, OMPI_MCA_ess_base_jobid="960495617")) for r in (0, 1)}
    assert {(c.master_addr, c.master_port) for c in found} == {
        ("127.0.0.1", derived_port("960495617"))
    }
    assert {(c.rank, c.local_rank, c.local_world_size) for c in found} == {(0, 0, 2), (1, 1, 2)}


def test_a_pmix_namespace_is_a_job_id_too_and_master_port_wins() -> None:
    c = detect(_ompi(0, 2, 2, PMIX_NAMESPACE="prterun-vm-77@1"))
    assert c.master_port == derived_port("prterun-vm-77@1")
    c = detect(_ompi(0, 2, 2, PMIX_NAMESPACE="x", MASTER_PORT="29611"))
    assert (c.master_addr, c.master_port) == ("127.0.0.1", 29611)


def test_derived_ports_are_in_range_and_differ_by_job() -> None:
    ports = {derived_port(str(job)) for job in range(1000, 1020)}
    assert all(20000 <= p < 40000 for p in ports) and len(ports) > 1
    assert slurm_port("4242") == derived_port("4242")


def test_mpi_across_hosts_without_master_addr_names_the_flags_to_pass() -> None:
    with pytest.raises(LauncherEnvError) as info:
        detect(_ompi(0, 4, 2, OMPI_MCA_ess_base_jobid="7"))
    text = str(info.value)
    assert "OMPI_COMM_WORLD_SIZE=4" in text and "OMPI_COMM_WORLD_LOCAL_SIZE=2" in text
    assert "mpirun -x MASTER_ADDR=<address of rank 0's host> -x MASTER_PORT=29500" in text
    assert "pip install 'meshrun[mpi]'" in text
    mpich = {"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
    with pytest.raises(LauncherEnvError, match=r"mpiexec -genv MASTER_ADDR .* -genv MASTER_PORT"):
        detect(mpich)


def test_mpich_on_one_host_has_no_job_id_so_it_asks_for_the_port_only() -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    with pytest.raises(LauncherEnvError, match="mpiexec -genv MASTER_PORT 29500") as info:
        detect(env)
    assert "all on this host (rank 0 at 127.0.0.1)" in str(info.value)
    c = detect({**env, "MASTER_PORT": "29612"})
    assert (c.master_addr, c.master_port, c.local_rank, c.local_world_size) == (
        "127.0.0.1",
        29612,
        1,
        2,
    )


def test_mpi_without_a_local_size_is_not_taken_for_one_host() -> None:
    with pytest.raises(LauncherEnvError, match="MASTER_ADDR") as info:
        detect({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    assert "OMPI_COMM_WORLD_RANK" in str(info.value)


def test_master_addr_from_the_env_wins_over_derivation() -> None:
    c = detect(_ompi(3, 4, 2, MASTER_ADDR="10.0.0.7"))
    assert (c.master_addr, c.master_port, c.node_rank) == ("10.0.0.7", 29500, 1)


def test_mpi_with_one_process_needs_no_master_addr() -> None:
    c = detect({"PMI_RANK": "0", "PMI_SIZE": "1"})
    assert c.kind == "mpi"
    assert (c.world_size, c.local_rank, c.local_world_size) == (1, 0, 1)
    assert c.master_addr == "127.0.0.1"
    assert not c.distributed


# --- plain -------------------------------------------------------------------------------


def test_plain_env_is_single() -> None:
    c = detect({"PATH": "/usr/bin", "HOME": "/root"})
    assert c.kind == "single"
    assert (c.rank, c.world_size, c.local_rank, c.local_world_size, c.node_rank) == (0, 1, 0, 1, 0)
    assert not c.distributed
    assert c.hostname  # filled from socket.gethostname()


def test_a_partial_torchelastic_env_is_not_torchelastic() -> None:
    assert detect({"RANK": "0", "WORLD_SIZE": "2"}).kind == "single"


# --- expand_hostlist -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("node[01-03,07],login1", ["node01", "node02", "node03", "node07", "login1"]),
        ("a1", ["a1"]),
        ("x[9-11]", ["x9", "x10", "x11"]),
        ("gpu[01-02]", ["gpu01", "gpu02"]),
        ("a,b[1,3],c", ["a", "b1", "b3", "c"]),
        ("", []),
    ],
)
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts
