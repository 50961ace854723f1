"""A Kubeflow Trainer v2 TrainJob's pod, without the cluster: ``meshrun launch`` started with
the environment the ``torch-distributed`` runtime gives its trainer container (``PET_NNODES``,
``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``) trains the
demo on 2 processes over loopback with the same per-step losses as a plain
``meshrun launch --nproc-per-node 2``. Twice: the command ``meshrun k8s render --kind trainjob``
writes (c10d at ``$(PET_MASTER_ADDR):$(PET_MASTER_PORT)``, the rest from PET_*), and the
torchrun-style command a user writes into a TrainJob themselves (``meshrun launch SCRIPT``:
everything from PET_*, torchrun's static rendezvous)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.launch.k8s.render import K8sJob
from meshrun.launch.k8s.trainjob import render_trainjob
from meshrun.runtime.ports import free_port

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 420  # a hang guard on a loaded 2-core machine, not a timing assert
DEMO = ["-m", "meshrun.demo", "--size", "tiny", "--steps", "3", "--corpus-bytes", "300000"]


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "MESHRUN_"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _launch(argv: list[str], cwd: Path, env: dict[str, str]) -> str:
    """``meshrun ARGV`` (argv[0] == "meshrun") in this interpreter; its stderr."""
    assert argv[0] == "meshrun", argv
    done = subprocess.run(
        [sys.executable, "-m", "meshrun", *argv[1:]],
        cwd=cwd,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stderr


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def _kubelet_expand(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)


@pytest.fixture(scope="module")
def plain_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    run_dir = tmp_path_factory.mktemp("plain")
    argv = ["meshrun", "launch", "--nproc-per-node", "2", *DEMO, "--run-dir", str(run_dir)]
    _launch(argv, run_dir, {})
    losses = _losses(run_dir)
    assert len(losses) == 3
    return losses


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
@pytest.mark.parametrize(
    "command", ["rendered", pytest.param("torchrun-style", marks=pytest.mark.heavy)]
)
def test_a_trainjob_pod_trains_as_meshrun_launch_does(
    command: str, plain_losses: list[float], tmp_path: Path
) -> None:
    run_dir = tmp_path / "trainjob"
    job = K8sJob(
        name="tj",
        image="img",
        module=DEMO[1],
        script_args=[*DEMO[2:], "--run-dir", str(run_dir)],
        nodes="1",
        nproc_per_node=2,
        max_restarts=0,
    )
    trainer = render_trainjob(job)["spec"]["trainer"]
    port = free_port()
    # What the torch plugin sets from the TrainJob (here PET_MASTER_ADDR is loopback, not
    # pod 0's DNS name <name>-node-0-0.<name>, and the port a free one, not 29500).
    pet = {
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NODE_RANK": "0",
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
    }
    if command == "rendered":
        argv = [_kubelet_expand(arg, pet) for arg in trainer["command"]]
    else:
        argv = ["meshrun", "launch", *DEMO, "--run-dir", str(run_dir)]
    err = _launch(argv, tmp_path, pet)
    for note in (
        "--nnodes 1 from PET_NNODES",
        "--nproc-per-node 2 from PET_NPROC_PER_NODE",
        "--node-rank 0 from PET_NODE_RANK",
    ):
        assert f"meshrun launch: {note} (torchrun's environment default)" in err
    backend = "" if command == "rendered" else "static "
    assert f"rendezvous {backend}127.0.0.1:{port}" in err
    assert _losses(run_dir) == plain_losses  # bitwise: same seed, world and global batch
