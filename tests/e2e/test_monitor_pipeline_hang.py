"""A pipeline hang through ``meshrun launch`` (torchrun's agent, 2 Gloo workers, PP 2 with
meshrun's run.pipeline / run.pipeline_step): the test SIGSTOPs the last stage while the first
waits for its gradient; the watchdog ends the job and the report names the stopped rank and
the point-to-point operation the other rank waits in (monitor/p2p.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_monitor_signals import stop  # kills this test's workers by their pid files

WORKER = Path(__file__).parent / "scripts" / "pp_hang_worker.py"
TIMEOUT_S = 5.0


@pytest.fixture
def parked_job(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """The pipeline job, its last stage parked in its loss function at step 3 (see the script);
    stopped and cleaned up at the end, also when the test fails."""
    cmd = [
        sys.executable,
        "-m",
        "meshrun",
        "launch",
        "--nproc-per-node",
        "2",
        str(WORKER),
        f"--job.run_dir={tmp_path / 'run'}",
        "--job.device=cpu",
        "--metrics.progress=false",
        "--data.global_batch=8",
        "--data.micro_batch=8",
        "--optim.steps=1000",
        "--parallel.pp=2",
        "--parallel.pp_microbatches=2",
        "--parallel.pp_schedule=1f1b",
        f"--monitor.step_timeout_s={TIMEOUT_S}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TEST_PARK_AT": "3"}
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        yield proc
    finally:
        stop(proc, tmp_path)


def wait_for_file(proc: subprocess.Popen[str], path: Path, limit_s: float) -> int:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return int(path.read_text())
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    raise AssertionError(f"{path} not written within {limit_s} s")


@pytest.mark.timeout(180)
def test_a_stopped_pipeline_stage_is_named_with_the_receive_the_other_waits_in(
    tmp_path: Path, parked_job: subprocess.Popen[str]
) -> None:
    pid = wait_for_file(parked_job, tmp_path / "run" / "parked", 120)
    os.kill(pid, signal.SIGSTOP)  # stage 1 stops inside its loss: stage 0 waits for a gradient
    t0 = time.monotonic()
    out, _ = parked_job.communicate(timeout=TIMEOUT_S + 60)
    elapsed = time.monotonic() - t0
    report = out[out.find("meshrun: hang detected") :]
    print(f"exit {parked_job.returncode} after {elapsed:.1f} s (step timeout {TIMEOUT_S:g} s)")
    print(report)
    assert parked_job.returncode != 0 and "meshrun: hang detected" in out, out[-3000:]
    # Ended by the step timeout's watchdog and meshrun's SIGKILL of the stopped stage (the wait
    # above: the step timeout plus start-up on a loaded machine), not torchrun's 30 s grace.
    assert "ended by meshrun launch with SIGKILL" in out, out[-3000:]
    assert "rank(s) 1 were stopped" in report, report
    assert "rank 0 (" in report and "in _wait_batch_p2p" in report, report
    # Steps 1-2 posted 2 forward sends and 2 gradient receives each (2 chunks); step 3's
    # first gradient, #5, never comes: rank 1 stopped before sending it.
    assert "rank 0 p2p: waits in recv #5 from rank 1 (" in report, report
    assert "posted send #" in report and "to rank 1 (" in report
    assert "rank(s) 1: unknown (no report)" in report
