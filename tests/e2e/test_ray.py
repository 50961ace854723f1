"""``meshrun ray launch`` on a real Ray runtime (ray[train] 2.60: Ray Train V2's TorchTrainer),
on CPU with Gloo, against ``meshrun launch`` (torchrun) as the reference.

Ray listens on every interface of its host and, where it finds one, swaps 127.0.0.1 for the
external address: every Ray process here runs inside a network namespace made by the test whose
only interface is loopback, so nothing binds the machine's own addresses, and the namespace's
processes are exactly this test's Ray. Teardown kills them by the namespace's pid list and
deletes it; never ``ray stop``, which stops every Ray process on the machine, other users'
too. Ray's start costs tens of seconds and about 3 GB: CI starts one, a local runtime that
``meshrun ray launch`` starts itself; the heavy variants share one head (``ray start --head``)
through ``--address``.

* (CI) with no ``--address`` a local runtime is started; a worker SIGKILLed after step 6 is
  retried by Ray (``--max-restarts 1``): the script resumes from step 4's checkpoint and every
  loss it logs equals ``meshrun launch --nproc-per-node 2``'s, bit for bit; the retried worker
  then raises with no restart left, and the failure is summarised (rank, host, cause,
  traceback); nothing is left running in the namespace;
* (heavy) the demo, 8 steps, by ``meshrun ray launch --workers 2 --address`` logs the per-step
  losses of ``meshrun launch --nproc-per-node 2``, bit for bit (same seed, same global batch);
* (heavy) ``--workers 3 --min-workers 2`` on the head's 2 CPUs trains on 2 workers, says so,
  and keeps the global batch the driver resolved for both worlds (accumulation absorbs it).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib
from ray_nodes import start_ray

import meshrun.demo

pytestmark = [pytest.mark.slow]
pytest.importorskip("ray.train.torch", reason="the `ray` extra (ray[train]) is not installed")

SCRIPTS = Path(__file__).parent / "scripts"
DEMO_CONFIG = Path(meshrun.demo.__file__).with_name("demo.toml")
STEPS = 8
DEMO_ARGS = ["--size", "tiny", "--corpus-bytes", "300000", f"--optim.steps={STEPS}"]
DEMO_ARGS += ["--checkpoint.interval=4", "--metrics.progress=false", "--job.timeout_s=60"]


def _need_root() -> None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (`ip`)")


class Namespace:
    """A network namespace with loopback only, its own Ray temp dir and token; removed after."""

    def __init__(self, root: Path) -> None:
        self.name = f"mrray{uuid.uuid4().hex[:6]}"
        subprocess.run(["ip", "netns", "add", self.name], check=True, timeout=30)
        subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True, timeout=30)
        token = root / "token"
        token.write_text(secrets.token_hex(32))
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env = {
            **env,
            "OMP_NUM_THREADS": "1",
            "RAY_TMPDIR": str(root),  # not /tmp/ray: other Ray users on this machine
            "RAY_AUTH_MODE": "token",  # a token of this test's own, not ~/.ray/auth_token
            "RAY_AUTH_TOKEN_PATH": str(token),
            "RAY_USAGE_STATS_ENABLED": "0",
        }

    def run(self, argv: list[str], timeout: float, log: Path) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the namespace, its output kept in ``log`` (and returned)."""
        with open(log, "w") as out:
            proc = subprocess.run(
                ["ip", "netns", "exec", self.name, *argv],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
                check=False,
            )
        return subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), "")

    def pids(self) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=30
        ).stdout
        return [int(p) for p in out.split()]

    def kill_all(self) -> None:
        for pid in self.pids():  # only what runs in this namespace: this test's Ray
            subprocess.run(["kill", "-9", str(pid)], capture_output=True)

    def remove(self) -> None:
        self.kill_all()
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def head() -> Iterator[Namespace]:
    """One Ray head (2 CPUs) for the module's jobs, at 127.0.0.1:6379 of its namespace."""
    _need_root()
    root = Path(tempfile.mkdtemp(prefix="mrray-"))  # short: Ray's socket paths must fit 107 B
    ns = Namespace(root)
    try:
        argv = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--num-cpus=2"]
        argv += ["--node-ip-address=127.0.0.1", "--port=6379", "--include-dashboard=false"]
        argv = ["ip", "netns", "exec", ns.name, *argv]
        start_ray(argv, ns.env, root / "ray-start.log", clean=ns.kill_all)
        yield ns
    finally:
        ns.remove()
        shutil.rmtree(root, ignore_errors=True)


def ray_launch(ns: Namespace, run_dir: Path, *argv: str, workers: int = 2) -> str:
    """``meshrun ray launch`` on the module's head; its output (it must succeed)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "meshrun", "ray", "launch", "--workers", str(workers)]
    cmd += ["--address", "127.0.0.1:6379"]
    proc = ns.run([*cmd, *argv, f"--job.run_dir={run_dir}"], 840, run_dir / "launcher.log")
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """Every (step, loss) the run logged, in order (a resumed run logs some steps twice)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [(r["step"], r["loss"]) for r in records if "step" in r and "loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The demo's losses under meshrun launch (torchrun), 2 processes."""
    run_dir = tmp_path_factory.mktemp("torchrun")
    argv = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2"]
    argv += ["-m", "meshrun.demo", *DEMO_ARGS, f"--job.run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = dict(losses(run_dir))
    assert sorted(found) == list(range(1, STEPS + 1))
    return found


# heavy: test_a_killed_worker_resumes_bitwise_then_a_failure_is_summarised_and_the_runtime_stopped
# compares every Ray loss with this reference
@pytest.mark.heavy
@pytest.mark.timeout(1500)
def test_demo_under_ray_gives_the_losses_of_meshrun_launch(
    head: Namespace, reference: dict[int, float], tmp_path: Path
) -> None:
    out = ray_launch(head, tmp_path / "ray", "-m", "meshrun.demo", *DEMO_ARGS)
    got = losses(tmp_path / "ray")
    print(f"meshrun launch: {reference}\nmeshrun ray launch: {got}")
    assert dict(got) == reference  # == on floats: bit for bit
    assert len(got) == STEPS
    assert "2 process(es)" in out and "cpu + gloo" in out, out[-3000:]  # Ray's group: gloo


# heavy (CI's time): a smaller world keeping the global batch runs in CI under meshrun launch
# (tests/dist/test_checkpoint.py); Ray's retry in
# test_a_killed_worker_resumes_bitwise_then_a_failure_is_summarised_and_the_runtime_stopped
@pytest.mark.heavy
@pytest.mark.timeout(1500)
def test_fewer_workers_than_asked_keep_the_global_batch(head: Namespace, tmp_path: Path) -> None:
    run_dir = tmp_path / "ray"
    script = str(SCRIPTS / "ray_hosts.py")
    out = ray_launch(head, run_dir, "--min-workers", "2", script, "--optim.steps=2", workers=3)
    data = tomllib.loads((run_dir / "config.toml").read_text())["data"]
    batch, micro = data["global_batch"], data["micro_batch"]
    assert batch % (micro * 2) == 0 and batch % (micro * 3) == 0, data  # fits both worlds
    line = "meshrun ray launch: world size 2 (--workers 3, --min-workers 2): the global batch "
    line += f"{batch} is kept, accumulation {batch // (micro * 2)} with micro-batch {micro}"
    assert line in out, out[-4000:]
    assert "ranks on hosts: " in out and "(gloo)" in out, out[-4000:]


@pytest.mark.timeout(1500)
def test_a_killed_worker_resumes_bitwise_then_a_failure_is_summarised_and_the_runtime_stopped(
    reference: dict[int, float], tmp_path: Path
) -> None:
    """One Ray runtime start (tens of seconds) for three checks: no ``--address`` starts a
    local runtime; rank 1 SIGKILLed after step 6 is retried and resumes from step 4's
    checkpoint bit for bit; the retried rank 1 then raises after step 7 with no restart
    left, and the failure is summarised (rank, host, cause, traceback); the runtime stops."""
    _need_root()
    root = Path(tempfile.mkdtemp(prefix="mrray-"))
    ns = Namespace(root)
    try:
        run_dir = tmp_path / "ray"
        run_dir.mkdir()
        marker = tmp_path / "killed"
        argv = [sys.executable, "-m", "meshrun", "ray", "launch", "--workers", "2"]
        argv += ["--max-restarts", "1", "--config", str(DEMO_CONFIG)]
        argv += [str(SCRIPTS / "ray_demo_killed_once.py"), "--kill-at-step", "6"]
        argv += ["--kill-marker", str(marker), "--raise-at-step", "7", *DEMO_ARGS]
        proc = ns.run([*argv, f"--job.run_dir={run_dir}"], 840, run_dir / "launcher.log")
        out = proc.stdout
        assert proc.returncode == 1, out[-4000:]
        assert "starting a local Ray runtime for this job" in out, out[-4000:]
        assert "2 process(es)" in out and "cpu + gloo" in out, out[-4000:]  # Ray's group: gloo
        assert marker.is_file(), "rank 1 never killed itself"
        assert "meshrun ray launch: worker group failed (rank 1" in out, out[-4000:]
        assert "Ray restarts it (1 of --max-restarts 1)" in out, out[-4000:]
        assert "meshrun: resumed from " in out and "(step 4," in out, out[-4000:]
        got = losses(run_dir)
        print(f"reference: {reference}\nkilled and resumed: {got}")
        steps = [step for step, _ in got]
        assert steps.count(5) == 2, steps  # logged before the kill, redone from step 4's checkpoint
        assert all(loss == reference[step] for step, loss in got), got  # bit for bit
        assert set(range(1, 7)) <= set(steps), steps
        assert "no restart left (--max-restarts 1)" in out, out[-4000:]
        summary = out[out.index("meshrun ray launch: rank 1 failed first (host ") :]
        assert "cause : exit code 1" in summary, summary
        assert "error : ValueError: bad batch on rank 1 at step 7" in summary, summary
        assert "traceback (from the error file written by @record):" in summary, summary
        assert "check_batch" in summary, summary  # the script's own frame
        deadline = time.monotonic() + 60  # a bound for the runtime's exit, not a timing assert
        while ns.pids() and time.monotonic() < deadline:
            time.sleep(1)
        assert ns.pids() == [], "the local Ray runtime outlived meshrun ray launch"
    finally:
        ns.remove()
        shutil.rmtree(root, ignore_errors=True)
