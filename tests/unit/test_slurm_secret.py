"""``meshrun slurm submit``'s script makes the job secret once per job in the batch step and
hands it to every node's ``meshrun launch`` through srun's environment: run here with bash, a
stand-in ``srun`` recording what its tasks would get. The secret is never printed nor on a
command line, a secret exported before sbatch is kept, and a direct launch (mpirun, srun
--mpi) makes none (no meshrun launch, nothing that reads it)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from meshrun.launch.slurm.submit import SubmitSpec, render_sbatch
from meshrun.launch.trust.secret import SECRET_FILE_ENV, resolve
from meshrun.runtime.secret import SECRET_ENV

pytestmark = pytest.mark.timeout(60)

# The stand-in srun: what each task would see (its environment's secret, its argv).
SRUN = """#!/bin/sh
exec python3 -c 'import json, os, sys
json.dump({"secret": os.environ.get("MESHRUN_JOB_SECRET"), "argv": sys.argv[1:]},
          open(os.environ["RECORD"], "w"))' "$@"
"""


def _run(tmp: Path, name: str, launcher: str = "meshrun", **env: str) -> tuple[dict, str]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    spec = SubmitSpec(
        target="/opt/t.py",
        nodes=2,
        output_dir=str(tmp / "out"),
        workdir=str(tmp),
        launcher=launcher,
        config_toml="[job]\n",
        config_path=str(tmp / "cfg" / "config.toml"),
    )
    script = tmp / f"{name}.sbatch"
    script.write_text(render_sbatch(spec))
    base = {k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_JOB_SECRET")}
    record = tmp / f"{name}.json"
    full = {
        **base,
        "PATH": f"{bin_dir}:{base['PATH']}",
        "SLURM_JOB_ID": "7",
        "RECORD": str(record),
        **env,
    }
    # -x: bash prints every command it runs, as a user debugging the script would see them.
    r = subprocess.run(
        ["bash", "-x", str(script)], cwd=tmp, env=full, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    return json.loads(record.read_text()), r.stdout + r.stderr + script.read_text()


def test_the_batch_step_makes_one_secret_every_task_inherits(tmp_path: Path) -> None:
    seen, output = _run(tmp_path, "a")
    secret = seen["secret"]
    assert isinstance(secret, str) and len(secret) == 64 and int(secret, 16) >= 0
    # What every node's meshrun launch then resolves (the environment wins over the run dir).
    got = resolve(str(tmp_path / "run"), {SECRET_ENV: secret}, create=True)
    assert got.key == secret.encode() and not (tmp_path / "run").exists()
    assert secret not in output  # not printed (even under bash -x), not in the script
    assert "+ srun " in output  # and bash's tracing is back on after the secret
    assert not any(secret in arg for arg in seen["argv"])  # not on srun's command line
    again, _ = _run(tmp_path, "b")
    assert again["secret"] != secret  # a new job (or a requeue) gets a new one


def test_a_secret_exported_before_sbatch_is_kept(tmp_path: Path) -> None:
    mine = "c0ffee" * 11
    seen, _ = _run(tmp_path, "env", MESHRUN_JOB_SECRET=mine)
    assert seen["secret"] == mine
    seen, _ = _run(tmp_path, "file", **{SECRET_FILE_ENV: str(tmp_path / "k")})
    assert seen["secret"] is None  # the file variable is passed on instead, as given


@pytest.mark.parametrize("launcher", ["mpirun", "srun"])
def test_a_direct_launch_makes_no_secret(launcher: str) -> None:
    spec = SubmitSpec(
        target="/opt/t.py",
        launcher=launcher,
        config_toml="[job]\n",
        config_path="/tmp/c/config.toml",
    )
    assert SECRET_ENV not in render_sbatch(spec)
