"""Two things a ported loop reads from ``Run`` under gradient accumulation: ``run.is_step_end``
is true only on the micro-step that steps the optimizer (``run.step % N == 0`` holds on every
micro-step of a window), and ``run.evaluate``'s time is left out of the step time and reported
on its own (``eval_s`` on the next step's line, an ``eval`` event)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "e2e" / "scripts" / "accum_eval_loop.py"
EVAL_SLEEP_S = 2.0  # far above a step of a 5-parameter model, so the step time shows it


@pytest.mark.timeout(180)  # the script's first import of torch is slow on a loaded machine
def test_is_step_end_and_eval_time_under_accumulation(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHRUN_", "PET_"))}
    argv = [sys.executable, str(SCRIPT), str(EVAL_SLEEP_S), f"--job.run_dir={tmp_path}"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    (out,) = [json.loads(s) for s in done.stdout.splitlines() if s.startswith('{"seen')]
    assert out["accum"] == 4
    # (run.step, run.is_step_end) after each run.optimizer_step: 3 micro-steps, then the step
    windows = [[[k, False]] * 3 + [[k + 1, True]] for k in range(3)]
    assert out["seen"] == [pair for window in windows for pair in window]
    # The trap is that run.step stays 2 for four micro-steps; is_step_end picks one of them.
    assert [s for s, end in out["seen"] if s == 2 and end] == [2]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in rows if "event" not in r and "step" in r}
    (event,) = [r for r in rows if r.get("event") == "eval"]
    assert event["step"] == 2 and event["seconds"] >= EVAL_SLEEP_S
    assert steps[3]["eval_s"] == pytest.approx(event["seconds"], rel=0.05)
    assert steps[3]["step_time_s"] < EVAL_SLEEP_S  # evaluation is not step time
    assert "eval_s" not in steps[2]
