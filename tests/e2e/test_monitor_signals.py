"""Issue 7 through ``meshrun launch`` (torchrun's agent, 2 Gloo workers), with a worker paused
from outside: SIGSTOP/SIGCONT bursts make rank 1 a real straggler, and a long SIGSTOP makes a
real hang that the watchdog turns into a non-zero exit and a report naming the stopped rank;
a rank stuck in its own code (it never calls the next collective) is named, from the flight
recorder's collective sequence numbers, as the rank that did not reach the collective.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

WORKER = """
import os
import signal
import time
import torch
from torch import nn
from torch.utils.data import TensorDataset
import meshrun


def work(x: torch.Tensor) -> torch.Tensor:
    # A fixed amount of compute (not a wall-clock wait, which would absorb a pause).
    w = torch.ones(192, 192) / 192
    h = torch.ones(192, 192)
    for _ in range(40):
        h = h @ w
    return x * h.mean()


@meshrun.main
def main() -> None:
    run = meshrun.init()
    pids = run.run_dir / "pids"
    pids.mkdir(exist_ok=True)
    (pids / f"rank{run.rank}").write_text(str(os.getpid()))
    data = TensorDataset(torch.randn(4096, 8), torch.randn(4096, 1))
    model = run.parallelize(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stall_at = int(os.environ.get("TEST_STALL_AT", "0"))
    phase = os.environ.get("TEST_STALL_PHASE", "")
    if phase == "agreement" and run.rank == 1:
        # Stuck entering the per-step agreement (the one all-reduce that also carries whether to
        # checkpoint; wrapped here only to put the stall exactly there): the peers wait for it
        # in that collective.
        agreement = run._parts.checkpointer.agreement
        exchange = agreement.exchange
        agreement.exchange = lambda step, **kw: (
            time.sleep(600) if step == stall_at else None
        ) or exchange(step, **kw)
    for x, y in run.steps(run.dataloader(data)):
        if phase == "stop_in_save" and run.step + 1 == stall_at:
            # Every rank in a phase allowed 600 s, as in a checkpoint save; rank 1 stops
            # itself there, after saying when: only the launcher can see it is stopped.
            with run.phase("checkpoint", timeout_s=600):
                if run.rank == 1:
                    (pids / "stopping").write_text(str(time.time()))
                    os.kill(os.getpid(), signal.SIGSTOP)
                torch.distributed.barrier()
        if run.rank == 1 and run.step + 1 == stall_at and phase not in ("agreement", "stop_in_save"):
            if phase:  # a long phase timeout: this rank's own deadline is far away
                with run.phase(phase, timeout_s=600):
                    time.sleep(600)
            time.sleep(600)  # stuck in user code: never reaches this step's collectives
        run.backward(nn.functional.mse_loss(model(work(x)), y))
        run.optimizer_step(opt)


if __name__ == "__main__":
    main()
"""


def launch(
    tmp_path: Path, *overrides: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    args = [
        "--job.run_dir=" + str(tmp_path / "run"),
        "--job.device=cpu",
        "--data.global_batch=16",
        "--data.micro_batch=8",
        "--metrics.progress=false",
        *overrides,
    ]
    cmd = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2", str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def stop(proc: subprocess.Popen[str], tmp_path: Path) -> None:
    """Leave nothing running, also after a failure: the workers (in their own sessions under
    torchrun's agent) by their pid files, checked to be this test's workers, then the launcher.
    The workers also when the launcher has gone: they would train on, orphaned."""
    pids = tmp_path / "run" / "pids"
    for f in pids.glob("rank*") if pids.is_dir() else []:
        try:
            pid = int(f.read_text())
            if str(tmp_path) in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                os.kill(pid, signal.SIGKILL)  # acts on a stopped process too
        except (ValueError, OSError):
            continue  # gone already
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``jobs(*overrides, env=...)`` launches the worker; every launch is stopped at the end."""
    procs: list[subprocess.Popen[str]] = []

    def start(*overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        procs.append(launch(tmp_path, *overrides, env=env))
        return procs[-1]

    yield start
    for proc in procs:
        stop(proc, tmp_path)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(x) for x in lines if x.endswith("}")]


def wait_for_step(proc: subprocess.Popen[str], run_dir: Path, step: int, limit_s: float) -> int:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        steps = [r["step"] for r in metrics(run_dir) if "event" not in r and "step" in r]
        if steps and steps[-1] >= step and (run_dir / "pids" / "rank1").exists():
            return int(steps[-1])
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no step {step} within {limit_s} s: {proc.communicate()[0][-3000:]}")


@pytest.mark.timeout(180)
def test_sigstop_bursts_make_rank_1_a_flagged_straggler(
    tmp_path: Path, jobs: Callable[..., subprocess.Popen[str]]
) -> None:
    every = 10  # steps per straggler check
    proc = jobs("--optim.steps=260", f"--monitor.straggler_every={every}", "--metrics.log_every=5")
    run_dir = tmp_path / "run"
    first = wait_for_step(proc, run_dir, 20, 90)
    pid = int((run_dir / "pids" / "rank1").read_text())
    t_end = time.monotonic() + 6.0
    while time.monotonic() < t_end:  # paused three quarters of the time, in 150 ms bursts
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.15)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)
    last = max(r["step"] for r in metrics(run_dir) if "event" not in r and "step" in r)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    flagged = [e for e in metrics(run_dir) if e.get("event") == "straggler"]
    print(
        f"bursts over steps {first}-{last}",
        "->",
        [(e["step"], e["rank"], e["component"], round(e["slower_by"], 1)) for e in flagged],
    )
    # Checks whose window overlaps the bursts: there the paused rank is flagged. Its peer can
    # be flagged too, by the shared machine's noise (other tests' load slows one process for a
    # window), so the ranks are told apart by the time their flags say they lost, not by how
    # many flags they drew (that failed once: 100 ms pauses half of 4 s got rank 1 one flag in
    # the window and rank 0 one at 2.0x). Pauses of 150 ms, three quarters of 6 s, cost rank 1
    # 1.3-2.4 s of its own time here beside a busy core, at 2.3-5.4x the median.
    during = [e for e in flagged if first < e["step"] <= last + every]
    lost = {
        r: sum((e["value_s"] - e["median_s"]) * every for e in during if e["rank"] == r)
        for r in (0, 1)
    }
    print("time lost per rank in the burst window (s):", lost)
    assert [e for e in during if e["rank"] == 1], (flagged, out[-3000:])
    assert lost[1] > lost[0], (lost, flagged)
    assert "straggler: rank 1 on" in out


@pytest.mark.timeout(180)
# Several runs: the exit path must not be a race. Five with MESHRUN_HEAVY_TESTS=1.
# heavy: attempts 1-4; attempt 0 stays (the same stopped worker, the same report)
@pytest.mark.parametrize(
    "attempt", [0, *(pytest.param(i, marks=pytest.mark.heavy) for i in range(1, 5))]
)
def test_a_stopped_worker_is_a_hang_reported_by_the_watchdog(
    tmp_path: Path, jobs: Callable[..., subprocess.Popen[str]], attempt: int
) -> None:
    timeout_s = 5.0
    proc = jobs("--optim.steps=100000", f"--monitor.step_timeout_s={timeout_s}")
    run_dir = tmp_path / "run"
    wait_for_step(proc, run_dir, 4 + attempt, 120)  # past the first step's longer timeout
    pid = int((run_dir / "pids" / "rank1").read_text())
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout_s + 60)
    finally:
        if proc.poll() is None:
            os.kill(pid, signal.SIGCONT)
            proc.kill()
    elapsed = time.monotonic() - t0
    print(f"exit {proc.returncode} after {elapsed:.1f} s (step timeout {timeout_s:g} s)")
    summary = out[out.find("meshrun launch: rank 1 failed first") :]
    print(summary)
    assert proc.returncode == 124, out[-3000:]  # the watchdog's code: the job hung
    # The product's promise, a hang does not wait for torchrun's 30 s SIGTERM grace, is
    # meshrun's own SIGKILL of the stopped rank in the summary below (the wait above is
    # bounded by the step timeout plus start-up on a loaded machine: a hang fails there).
    # The summary: rank 1 is the cause, stopped, and ended by meshrun itself (no OOM guess,
    # no advice to decorate a script that is decorated); rank 0 waits in its collective.
    assert "meshrun launch: rank 1 failed first" in out, out[-3000:]
    assert "cause : stopped (process state T: SIGSTOP or a debugger)" in summary
    assert "ended by meshrun launch with SIGKILL" in summary
    assert "out of memory" not in out and "decorate" not in out
    assert re.search(
        r"rank 0 \(exit code 124\): hang watchdog; waits in collective #\d+ \(gloo:\w+\) "
        r"of process group 0 \(default_pg\)",
        summary,
    ), summary
    assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"  # ended, not continued
    # The launcher names rank 1 as stopped; rank 0's stack says where it waits for it.
    assert "rank(s) 1 were stopped" in out
    report = out[out.find("meshrun: hang detected") :]
    assert "rank 1 (" not in report  # a dump rank 1 may write once continued is not the hang
    assert "rank 0 (" in out and "waits at" in out and "your code: worker.py:" in out
    assert (run_dir / "hang" / "rank0.txt").exists()
    # The flight recorder: rank 0's position in the default group; rank 1's is unknown.
    assert "on process group 0 (default_pg): rank(s) 0 at #" in report, report
    assert "rank(s) 1: unknown (no report)" in report


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def run_stalled(
    jobs: Callable[..., subprocess.Popen[str]], env: dict[str, str], wait_s: float = 150
) -> tuple[subprocess.Popen[str], str, str]:
    """Launch the worker with rank 1 stalled (``env``) and a 5 s step timeout; wait for the
    launcher to end the job. Returns the process, its stdout and the hang report in it."""
    proc = jobs("--optim.steps=100000", "--monitor.step_timeout_s=5", env=env)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=wait_s)
    report = out[out.find("meshrun: hang detected") :]
    print(f"exit {proc.returncode} after {time.monotonic() - t0:.1f} s")
    print(report)
    return proc, out, report


# heavy (CI's time): stopped and stalled ranks reported by the watchdog stay in CI in this file's
# other tests
@pytest.mark.heavy
@pytest.mark.timeout(180)
def test_a_rank_stopped_while_every_rank_is_in_a_long_phase_is_ended_by_the_launcher(
    tmp_path: Path, jobs: Callable[..., subprocess.Popen[str]]
) -> None:
    # No rank's deadline comes near (the phase allows 600 s): the launcher sees rank 1 in
    # process state T for step_timeout_s + 2 s and treats it as the hang it is.
    proc, out, report = run_stalled(
        jobs, {"TEST_STALL_AT": "6", "TEST_STALL_PHASE": "stop_in_save"}
    )
    stopped_at = float((tmp_path / "run" / "pids" / "stopping").read_text())
    elapsed = time.time() - stopped_at  # an upper bound: measured after communicate returned
    print(f"exit {proc.returncode} {elapsed:.1f} s after rank 1 stopped itself")
    assert proc.returncode == 124, out[-3000:]
    # The promise for a step holds in a save too: the launcher itself ends the stopped rank
    # (this line, after step_timeout_s + STOPPED_GRACE_S stopped), not the save's 600 s limit,
    # which run_stalled's bounded wait would not reach.
    assert "meshrun launch: rank 1 (pid" in out and "has been stopped (process state T)" in out
    assert "ended by meshrun launch with SIGKILL" in out, out[-3000:]
    summary = out[out.find("meshrun launch: rank 1 failed first") :]
    assert "cause : stopped (process state T: SIGSTOP or a debugger)" in summary, out[-3000:]
    assert "in phase checkpoint" in report and "rank 0 (" in report, report


# heavy (CI's time): the watchdog's hang reports stay in CI in this file's other tests
@pytest.mark.heavy
@pytest.mark.timeout(180)
def test_a_rank_whose_own_deadline_is_far_reports_when_another_rank_does(
    jobs: Callable[..., subprocess.Popen[str]],
) -> None:
    # Rank 1 sleeps inside a phase allowed 600 s; rank 0 waits for it in a collective and its
    # 5 s step timeout fires first. Rank 0's exit used to end rank 1 before it could report;
    # now the launcher asks every rank for its stacks before anyone exits.
    proc, out, report = run_stalled(jobs, {"TEST_STALL_AT": "6", "TEST_STALL_PHASE": "eval"})
    assert proc.returncode == 124 and "meshrun: hang detected" in out, out[-3000:]
    assert "meshrun watchdog: rank 1 was asked for its stacks" in out, out[-3000:]
    assert "rank 1 (" in report and "in phase eval after step 5" in report, report
    assert "your code: worker.py:" in report
    assert "rank 1 at #" in report and "rank(s) 1 did not reach #" in report, report
    assert "did not report" not in report


@pytest.mark.timeout(180)
def test_a_rank_that_skips_a_collective_is_named_by_sequence_number(
    jobs: Callable[..., subprocess.Popen[str]],
) -> None:
    proc, out, report = run_stalled(jobs, {"TEST_STALL_AT": "12"})
    assert proc.returncode != 0 and "meshrun: hang detected" in out, out[-3000:]
    # Both ranks report: rank 0 waits in a collective rank 1 never called; rank 1 is in its
    # own code (worker.py, the sleep), one collective behind.
    assert "rank 1 (" in report and "in phase train after step 11" in report
    assert "rank 1 at #" in report and "rank(s) 1 did not reach #" in report, report
    assert "gloo:" in report


# heavy (CI's time): stopped and stalled ranks reported by the watchdog stay in CI in this file's
# other tests
@pytest.mark.heavy
@pytest.mark.timeout(150)
def test_a_rank_stuck_in_the_checkpoint_agreement_is_a_hang_within_the_step_timeout(
    jobs: Callable[..., subprocess.Popen[str]],
) -> None:
    # Every step's end reads whether to checkpoint (the preemption flag, agreed in the step's
    # one all-reduce). That runs under the step timeout, not the checkpoint phase's (1800 s), so
    # a rank stuck entering it ends the job as any hang does: its peers wait in that collective.
    proc, out, report = run_stalled(
        jobs, {"TEST_STALL_AT": "8", "TEST_STALL_PHASE": "agreement"}, wait_s=120
    )
    assert proc.returncode != 0 and "meshrun: hang detected" in out, out[-3000:]
    # Both ranks report from the train phase (not "checkpoint"), in step 8's exchange (after
    # step 7): rank 0 waits in the agreement's all-reduce that rank 1 did not reach.
    assert re.search(
        r"rank 0 \([^)]*\) in phase train after step 7: waits at .* in all_reduce", report
    ), report
    assert re.search(r"rank 1 \([^)]*\) in phase train after step 7", report), report
    assert re.search(r"rank\(s\) 1 did not reach #\d+", report), report
