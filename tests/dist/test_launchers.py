"""``meshrun.init()`` started by something other than torchrun: SLURM's ``srun`` (no torchrun)
and an MPI launcher. The launchers themselves are not needed to test meshrun's side: each of
them only sets environment variables, so real Gloo processes get exactly those variables
(and none of torchrun's) and must form a working process group from them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import meshrun
from _dist import run_distributed

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def as_launcher(kind: str, rank: int, world: int, port: str) -> dict[str, str]:
    if kind == "slurm":
        return {
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": str(world),
            "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0",
            "SLURM_NNODES": "1",
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_ID": f"4242{port}",
        }
    return {  # Open MPI; MPI says nothing about rank 0's address, so the user exports it
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(world),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
    }


def start_under(rank: int, world: int, kind: str, run_dir: str) -> dict[str, Any]:
    port = os.environ["MASTER_PORT"]
    for name in TORCHRUN_VARS:
        os.environ.pop(name, None)
    if kind == "slurm":
        os.environ.pop("MASTER_PORT")  # SLURM derives the port from the job id
    os.environ.update(as_launcher(kind, rank, world, port))
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.timeout_s, cfg.metrics.progress = run_dir, 60.0, False
    cfg.data.global_batch, cfg.data.micro_batch = 4, 2
    run = meshrun.init(cfg, argv=[])
    total = torch.tensor([float(run.rank + 1)])
    dist.all_reduce(total)
    out = {"kind": run.cluster.kind, "rank": run.rank, "world": run.world_size, "sum": total.item()}
    run.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["slurm", "mpi"])
def test_init_under_srun_and_mpi_forms_the_process_group(kind: str, tmp_path: Path) -> None:
    results = run_distributed(start_under, 2, kind, str(tmp_path), timeout=90)
    assert [r["kind"] for r in results] == [kind, kind]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 for r in results)
