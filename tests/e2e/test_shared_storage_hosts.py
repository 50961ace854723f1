"""Two hosts without a shared filesystem: network-namespace hosts (tests/netns.py), each with
its own disk mounted at the same run-directory path (a mount namespace per host binds a
host-local directory there), run the demo across both with `meshrun launch --nnodes 2`. Both
stop in `meshrun.init`, before step 1 and before the corpus is prepared, with the error that
names the directory each host sees and says to put it on shared storage. (Before: rank 1
failed in the demo with `FileNotFoundError: .../corpus/stdlib-.../manifest.json`.) Both nodes
get the job secret in MESHRUN_JOB_SECRET, as nodes without a shared directory must (without
it the joining node would stop at the secret, tested in tests/e2e/test_trust_rendezvous.py)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

import netns

pytestmark = pytest.mark.slow
PORT = 29547
# Inside the host's own mount namespace: its local directory ($0) appears at the run dir ($1).
BIND = 'mount --bind "$0" "$1" && shift && exec "$@"'


@pytest.mark.timeout(240)
def test_two_hosts_with_their_own_run_dirs_stop_before_step_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"  # the same path on both hosts, as a job script gives it
    local = [tmp_path / "disk-node0", tmp_path / "disk-node1"]
    for d in (run_dir, *local):
        d.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "100"}
    env["MESHRUN_JOB_SECRET"] = secrets.token_hex(32)
    demo = ["-m", "meshrun.demo", "--steps", "2", "--size", "tiny", f"--job.run_dir={run_dir}"]
    with netns.hosts(2) as net:
        endpoint = f"{net.address(0)}:{PORT}"
        procs = []
        for i in (1, 0):  # the joining node first: it waits for the store
            launch = [sys.executable, "-m", "meshrun", "launch", "--nnodes", "2"]
            launch += ["--node-rank", str(i), "--rdzv-endpoint", endpoint, "--join-timeout", "90"]
            launch += ["--nproc-per-node", "1", *demo]
            own_disk = ["unshare", "--mount", "--propagation", "private", "sh", "-c", BIND]
            argv = net.argv(i, [*own_disk, str(local[i]), str(run_dir), *launch])
            procs.append(
                (
                    i,
                    subprocess.Popen(
                        argv, stdout=subprocess.PIPE, text=True, stderr=subprocess.STDOUT, env=env
                    ),
                )
            )
        outs = {}
        try:
            for i, proc in procs:
                outs[i] = (proc.communicate(timeout=180)[0], proc.returncode)
        finally:
            for _, proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    for out, code in outs.values():
        assert code != 0, out[-3000:]
        assert "job.run_dir is not shared by all ranks: rank 0 on node0 wrote" in out, out[-4000:]
        assert f"rank 1 on node1 in {run_dir}" in out, out[-4000:]
        assert "--job.run_dir=/shared/runs/NAME" in out
        assert "FileNotFoundError" not in out
    for disk in local:  # nothing trained, nothing prepared; the launcher's config is there
        assert (disk / "config.toml").is_file()
        assert not (disk / "metrics.jsonl").exists() and not (disk / "corpus").exists()
        assert not list(disk.glob(".meshrun-shared-*"))  # rank 0 removed its marker
    assert not list(run_dir.iterdir())  # the real directory under the mounts stayed empty
