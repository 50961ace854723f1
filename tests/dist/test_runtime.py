"""``meshrun.init()`` under the torchrun environment, in 2 real Gloo processes: rank, world and
mesh figures, per-rank log files, the config written by rank 0, a mesh/world mismatch named on
every rank, and the seeds (same torch stream everywhere, per-rank Python/NumPy streams).

One spawn serves every test here (a module-scoped fixture): process starts cost seconds.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import meshrun
from _dist import run_distributed

WORLD = 2


def make_config(run_dir: Path) -> meshrun.Config:
    cfg = meshrun.Config()
    cfg.job.run_dir = str(run_dir)
    cfg.job.device = "cpu"
    cfg.job.timeout_s = 60.0
    cfg.data.global_batch = 8
    cfg.data.micro_batch = 2
    cfg.metrics.progress = False
    return cfg


def start_and_report(rank: int, world_size: int, cfg: meshrun.Config) -> dict[str, Any]:
    """Runs in each rank: a bad init first (it fails before any process-wide effect, so the
    real one may follow in the same process), then the real one."""
    bad = make_config(Path(cfg.job.run_dir))
    bad.parallel.dp_shard = 3
    try:
        meshrun.init(bad, argv=[])
        mismatch = "no error"
    except meshrun.ConfigError as e:
        mismatch = str(e)
    run = meshrun.init(cfg, argv=[])
    assert run.mesh is not None
    report: dict[str, Any] = {
        "mismatch": mismatch,
        "ids": (run.rank, run.world_size, run.local_rank, run.dp_rank, run.dp_size, run.is_main),
        "dist": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
        "mesh": (run.mesh.mesh_dim_names, tuple(run.mesh.shape), run.mesh.device_type),
        "device": (run.device.type, run.backend, run.cluster.kind, run.accum),
        "draws": (torch.rand(1).item(), random.random(), float(np.random.rand())),
    }
    if rank == 1:
        run.log.warning("x")
    run.close()
    report["initialized_after_close"] = dist.is_initialized()
    return report


@dataclass
class Started:
    cfg: meshrun.Config
    run_dir: Path
    reports: list[dict[str, Any]]


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Started:
    cfg = make_config(tmp_path_factory.mktemp("runtime") / "run")
    reports = run_distributed(start_and_report, WORLD, cfg, timeout=60)
    return Started(cfg, Path(cfg.job.run_dir), reports)


@pytest.mark.timeout(90)
def test_init_reports_ranks_mesh_device_and_backend(started: Started) -> None:
    for rank, r in enumerate(started.reports):
        assert r["ids"] == (rank, WORLD, rank, rank, WORLD, rank == 0)
        assert r["dist"] == (rank, WORLD, "gloo")
        assert r["mesh"] == (("dp",), (WORLD,), "cpu")
        # global 8 = micro 2 x accumulation 2 x dp 2
        assert r["device"] == ("cpu", "gloo", "torchelastic", 2)
        assert r["initialized_after_close"] is False


@pytest.mark.timeout(90)
def test_each_rank_logs_to_its_own_file(started: Started) -> None:
    logs = started.run_dir / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["rank0.log", "rank1.log"]
    tagged = re.compile(r"^\S+ \S+ WARNING \[rank 1\] x$", re.MULTILINE)
    assert tagged.search((logs / "rank1.log").read_text())
    assert not re.search(r"WARNING .* x$", (logs / "rank0.log").read_text(), re.MULTILINE)
    # rank 0's log also holds the start-up line.
    assert "2 process(es) [torchelastic] on cpu + gloo" in (logs / "rank0.log").read_text()


@pytest.mark.timeout(90)
def test_rank0_writes_a_config_that_loads_back(started: Started) -> None:
    written = started.run_dir / "config.toml"
    assert written.is_file()
    assert meshrun.load_config(written) == started.cfg  # dataclass equality: every key


@pytest.mark.timeout(90)
def test_mesh_world_mismatch_names_dp_shard_on_every_rank(started: Started) -> None:
    for rank, r in enumerate(started.reports):
        assert "dp_shard" in r["mismatch"], f"rank {rank}: {r['mismatch']}"
        assert "world size is 2" in r["mismatch"], f"rank {rank}: {r['mismatch']}"


@pytest.mark.timeout(90)
def test_torch_seed_is_shared_and_python_numpy_seeds_differ_per_rank(started: Started) -> None:
    (torch0, py0, np0), (torch1, py1, np1) = (r["draws"] for r in started.reports)
    assert torch0 == torch1  # identical initial weights on every rank
    assert py0 != py1  # per-rank data augmentation
    assert np0 != np1
