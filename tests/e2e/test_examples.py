"""End to end: the examples and the README's commands, run as a user runs them (real `meshrun`
and `torchrun` processes on Gloo). The demo on 1 and 2 processes is checked on
tests/e2e/test_scale_report.py's runs of it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def sh(
    args: list[str], timeout: float = 150, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "EXAMPLE_TIMEOUT_S": "60",
        "COLUMNS": "100",
        **(env or {}),
    }
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def meshrun(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return sh([sys.executable, "-m", "meshrun", *args], timeout=timeout)


def steps_of(run_dir: Path) -> list[dict[str, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [r for r in rows if "event" not in r]


def assert_ok(p: subprocess.CompletedProcess[str]) -> None:
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


# The demo on 1 and 2 processes, its losses step by step the same, its step breakdown and what
# it leaves behind: checked on the two runs of tests/e2e/test_scale_report.py's scale test (the
# same tiny demo, the same 6 steps, the same global batch), which would otherwise run it again.


@pytest.mark.timeout(200)
# `meshrun launch -m meshrun.demo` runs in CI in test_resume_chaos, test_multinode, test_mpirun, ...
@pytest.mark.heavy
def test_demo_module_runs_under_meshrun_launch(tmp_path: Path) -> None:
    p = meshrun(
        "launch",
        "--nproc-per-node",
        "2",
        "-m",
        "meshrun.demo",
        "--steps",
        "3",
        "--size",
        "tiny",
        f"--job.run_dir={tmp_path}",
    )
    assert_ok(p)
    assert [r["step"] for r in steps_of(tmp_path)] == [1, 2, 3]


# heavy (CI's time): the minimal example runs in CI on three processes (test_world_sizes.py)
@pytest.mark.heavy
@pytest.mark.timeout(200)
def test_ddp_minimal_example(tmp_path: Path) -> None:
    p = meshrun(
        "launch",
        "--nproc-per-node",
        "2",
        "examples/ddp_minimal.py",
        "--optim.steps=20",
        f"--job.run_dir={tmp_path}",
    )
    assert_ok(p)
    rows = steps_of(tmp_path)
    assert len(rows) == 20
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert len((ROOT / "examples" / "ddp_minimal.py").read_text().splitlines()) < 40


# heavy (CI's time): the same script under `meshrun launch`, "ok: 3 replicas identical", runs in
# CI in test_world_sizes.py::test_a_plain_torchrun_script_starts_with_the_default_config[3]
@pytest.mark.heavy
@pytest.mark.timeout(170)  # one launch, given 150 s: a guard against hangs only
def test_ddp_plain_runs_unchanged_under_meshrun(tmp_path: Path) -> None:
    # Under torchrun it runs in test_ddp_plain_does_not_depend_on_the_interpreter_teardown
    # (with an abort at every worker's exit, which it does not reach).
    script = str(ROOT / "examples" / "ddp_plain.py")
    p = meshrun("launch", "--nproc-per-node", "2", "--set", f"job.run_dir={tmp_path}", script)
    assert_ok(p)
    assert "ok: 2 replicas identical" in p.stdout


ABORT_AT_TEARDOWN = """import atexit, os, signal
# What Gloo does at random at a worker's interpreter exit (SIGABRT, "terminate called without
# an active exception"), done every time: a script that skips the teardown is not hit by it.
if "LOCAL_RANK" in os.environ:  # torchrun's workers, not its agent
    atexit.register(lambda: os.kill(os.getpid(), signal.SIGABRT))
"""


@pytest.mark.timeout(170)
def test_ddp_plain_does_not_depend_on_the_interpreter_teardown(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(ABORT_AT_TEARDOWN)  # loaded by each worker
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    env = {"PYTHONPATH": str(tmp_path)}
    p = sh(
        [*torchrun, "--standalone", str(ROOT / "examples" / "ddp_plain.py")], cwd=tmp_path, env=env
    )
    assert_ok(p)
    assert "ok: 2 replicas identical" in p.stdout


@pytest.mark.timeout(60)
def test_readme_transcripts_are_true() -> None:
    # Every "$ meshrun ..." line in the README's code blocks prints what the README shows.
    readme = (ROOT / "README.md").read_text()
    transcripts = re.findall(r"^\$ (meshrun [^\n]+)\n((?:(?!\$ |```)[^\n]*\n)+)", readme, re.M)
    assert transcripts, "the README should show at least one command with its output"
    for command, expected in transcripts:
        p = meshrun(*command.split()[1:], timeout=40)
        for line in expected.strip().splitlines():
            assert line.strip() in p.stdout + p.stderr, f"{command!r} no longer prints {line!r}"


@pytest.mark.timeout(240)
def test_failing_rank_is_named_first_with_its_traceback(tmp_path: Path) -> None:
    # Rank 0 must not wait in its next collective for a timeout (job.timeout_s 600 s, the step
    # watchdog 300 s): the launch is given 200 s, a bound no loaded machine needs and no
    # waiting job meets (no window that depends on the machine's speed).
    script = ROOT / "tests" / "e2e" / "scripts" / "meshrun_raise_rank1.py"
    p = meshrun(
        "launch", "--nproc-per-node", "2", str(script), f"--job.run_dir={tmp_path}", timeout=200
    )
    out = p.stdout + p.stderr
    assert p.returncode != 0
    summary = out[out.index("failed first") - 40 :]
    assert "rank 1 failed first" in summary
    assert "bad batch on rank 1 at step 3" in summary
    assert "check_batch" in summary  # the traceback, not just the message
