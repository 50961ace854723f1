"""The failure summary after a hang and after a teardown abort, and the restart line: pure
functions on failure records and the files the watchdog and the launcher write."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from meshrun.launch.agent.failures import REFUSALS, HangStates, summarize_failures
from meshrun.launch.agent.watch import AgentWatch, describe_failures
from meshrun.monitor.watchdog import (
    ENDED_FILE,
    HANG_DIR,
    Watchdog,
    hang_report,
    hang_states,
    local_workers,
)


@dataclass
class Failure:
    """What the summary reads of torch's ProcessFailure."""

    local_rank: int
    exitcode: int
    timestamp: int = 1_700_000_000
    pid: int = 4242
    error_file: str = "<N/A>"
    error_file_data: dict[str, Any] = field(default_factory=lambda: {"message": "<NONE>"})


@pytest.mark.timeout(10)
def test_a_rank_meshrun_ended_after_a_hang_is_named_stopped_not_oom(tmp_path: Path) -> None:
    Watchdog(tmp_path, rank=0, world_size=2, timeout_s=5.0)._dump("train", 9)
    (tmp_path / HANG_DIR / ENDED_FILE).write_text(json.dumps({"1": "stopped"}))
    ended, waiting = hang_states(tmp_path, since=0.0)
    assert ended == {1: "stopped"}
    assert waiting[0].startswith("waits ")  # a collective where the recorder has one, else a frame
    # Rank 0 exited first (124) and rank 1 was SIGKILLed after it: rank 1 is still the cause.
    failures = {0: Failure(0, exitcode=124, timestamp=1), 1: Failure(1, -signal.SIGKILL, 2)}
    report = summarize_failures(failures, None, "h", HangStates(ended, waiting))
    assert report.first_rank == 1 and report.exit_code == 124
    assert "cause : stopped (process state T: SIGSTOP or a debugger)" in report.text
    assert "ended by meshrun launch with SIGKILL" in report.text
    assert "out of memory" not in report.text and "decorate" not in report.text
    assert "no traceback: a rank ended by SIGKILL writes no error file" in report.text
    assert f"rank 0 (exit code 124): hang watchdog; {waiting[0]}" in report.text
    text = hang_report(tmp_path, since=0.0)
    assert text is not None and "rank(s) 1 were stopped (process state T" in text
    assert "did not report" not in text  # rank 1 is accounted for: stopped


@pytest.mark.timeout(10)
def test_a_rank_that_did_not_answer_is_named_not_responding(tmp_path: Path) -> None:
    Watchdog(tmp_path, rank=0, world_size=3, timeout_s=5.0)._dump("train", 3)
    (tmp_path / HANG_DIR / ENDED_FILE).write_text(json.dumps({"2": "not responding"}))
    text = hang_report(tmp_path, since=0.0)
    assert text is not None
    assert "rank(s) 2 were not responding" in text and "rank(s) 1 did not report" in text
    ended, waiting = hang_states(tmp_path, since=0.0)
    failures = {0: Failure(0, 124), 2: Failure(2, -signal.SIGKILL)}
    report = summarize_failures(failures, None, "h", HangStates(ended, waiting))
    assert report.first_rank == 2 and "cause : not responding" in report.text


@pytest.mark.timeout(10)
def test_gloo_teardown_abort_is_described_as_what_it_is(tmp_path: Path) -> None:
    attempt = tmp_path / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    (attempt / "0" / "stderr.log").write_text(
        "done\nterminate called without an active exception\n"
    )
    report = summarize_failures({0: Failure(0, -signal.SIGABRT)}, str(attempt), "h")
    assert "SIGABRT: a C++ abort at interpreter exit" in report.text
    assert "@meshrun.main leaves through os._exit" in report.text
    assert "NCCL/CUDA error" not in report.text
    # Another SIGABRT keeps the general words, which no longer guess NCCL first.
    other = summarize_failures({0: Failure(0, -signal.SIGABRT)}, None, "h")
    assert "an uncaught C++ exception" in other.text and "interpreter exit" not in other.text


@pytest.mark.timeout(10)
def test_a_positive_exit_without_traceback_keeps_the_decorate_advice() -> None:
    report = summarize_failures({0: Failure(0, 3)}, None, "h")
    assert "no traceback captured (no error file, empty stderr)" in report.text
    assert "@meshrun.main" in report.text


@pytest.mark.timeout(10)
def test_the_restart_line_follows_the_agents_metrics() -> None:
    said: list[str] = []
    watch = AgentWatch(max_restarts=2, rdzv_bound_s=None, say=said.append)
    watch.last_failures = {1: Failure(1, 3), 0: Failure(0, 124)}
    for remaining in (2, 1):  # the agent's tick: remaining_restarts, then the state
        watch.on_metric("workers.default.remaining_restarts", remaining)
        watch.on_metric("workers.default.failed", 1)
    watch.on_metric("workers.default.remaining_restarts", 0)
    watch.on_metric("workers.default.failed", 1)  # no restart left: the launch fails
    assert said == [
        "worker group failed (rank 0: exit code 124 (hang watchdog), rank 1: exit code 3); "
        "restart 1 of 2",
        "worker group failed (rank 0: exit code 124 (hang watchdog), rank 1: exit code 3); "
        "restart 2 of 2",
    ]
    assert watch.finished
    assert describe_failures({3: Failure(3, -signal.SIGKILL)}) == "rank 3: signal SIGKILL"
    # The agent SIGTERMs the survivors of a failure: they are not what failed.
    stopped = {0: Failure(0, -signal.SIGTERM), 1: Failure(1, 3)}
    assert describe_failures(stopped) == "rank 1: exit code 3"


@pytest.mark.timeout(20)
def test_local_workers_finds_stopped_children_and_skips_zombies() -> None:
    env = {**os.environ}
    procs = [
        subprocess.Popen(["sleep", "30"], env={**env, "RANK": str(rank)}) for rank in (0, 1, 2)
    ]
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)
        procs[2].kill()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the kernel shows both changes
            found = {w.rank: w for w in local_workers(os.getpid())}
            if set(found) == {0, 1} and found[1].stopped:
                break
            time.sleep(0.05)
        assert set(found) == {0, 1}  # rank 2 is a zombie (exited, not reaped): not a worker
        assert found[1].stopped and found[1].state == "T" and not found[0].stopped
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _refusal_classes() -> set[str]:
    """ConfigError and every class in src/meshrun that derives from it, read from the source."""
    bases: dict[str, set[str]] = {}
    for path in (Path(__file__).parents[2] / "src" / "meshrun").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                }
                bases.setdefault(node.name, set()).update(names)
    found = {"ConfigError"}
    while grown := {c for c, b in bases.items() if b & found} - found:
        found |= grown
    return found


@pytest.mark.timeout(30)
def test_a_refusal_is_shown_whole_without_a_traceback(tmp_path: Path) -> None:
    assert _refusal_classes() == set(REFUSALS)  # a new refusal class is named in the summary
    text = "ConfigError: tensor parallel over 2 ranks breaks the forward of layers.0.attn " + (
        "(Attention, train.py:37): set parallel.tp=1 " * 4
    )
    error = tmp_path / "error.json"
    error.write_text("{}")
    data = {"message": {"message": text, "extraInfo": {"py_callstack": "Traceback (most..."}}}
    failures = {
        1: Failure(1, 1, timestamp=1, error_file=str(error), error_file_data=data),
        0: Failure(0, 1, timestamp=2, error_file=str(error), error_file_data=data),
    }
    report = summarize_failures(failures, None, "h")
    assert report.first_rank == 1 and report.exit_code == 1
    assert "meshrun launch: rank 1 refused the run (host h)" in report.text
    body = " ".join(line.strip() for line in report.text.splitlines())
    assert " ".join(text.split()) in body.replace("error : ", "")  # whole, not cut at 100
    assert "Traceback" not in report.text and f"traceback: in {error}" in report.text
    assert "rank 0 (exit code 1): the same refusal" in report.text
    wrapped = [x for x in report.text.splitlines() if x.startswith(("  error : ", " " * 10))]
    assert len(wrapped) > 2 and all(len(line) <= 78 for line in wrapped)  # a terminal's width
    crash = {0: Failure(0, 1, error_file_data={"message": {"message": "KeyError: 0"}})}
    assert "rank 0 failed first" in summarize_failures(crash, None, "h").text
