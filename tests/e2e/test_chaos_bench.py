"""benchmarks/chaos.py at CI size: the real benchmark (real ``meshrun launch``, real Gloo
workers, a really corrupted checkpoint file), one faulted run on 2 DDP ranks with a fixed seed,
against its uninterrupted reference: it must pass bitwise, finish and lose no checkpoint. The full figure (``--n 100``, every fault kind) is in docs/checkpoint.md.
Also the benchmark's pure parts: which runs it plans, and its refusal of unknown names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import scripts

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"


def load_chaos() -> ModuleType:
    return scripts.load(SCRIPT, "_chaos_bench", register=True)  # for its dataclasses


def test_plan_covers_every_fault_and_config_pair() -> None:
    chaos = load_chaos()
    faults, configs = list(chaos.FAULTS), list(chaos.CONFIGS)
    runs = chaos.plan(len(faults) * len(configs), faults, configs)
    assert sorted(runs) == sorted((f, c) for f in faults for c in configs)
    assert chaos.plan(3, ["kill_step", "corrupt"], ["ddp2"]) == [
        ("kill_step", "ddp2"),
        ("corrupt", "ddp2"),
        ("kill_step", "ddp2"),
    ]


def test_unknown_fault_is_refused_naming_the_choices() -> None:
    chaos = load_chaos()
    assert chaos.parse_names("kill,corrupt", chaos.FAULTS, "fault") == [
        "kill_step",
        "kill_save",
        "kill_resume",
        "corrupt",
    ]
    with pytest.raises(SystemExit, match="unknown fault 'sigkill'; choose from kill_step"):
        chaos.parse_names("sigkill", chaos.FAULTS, "fault")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_corrupt_run_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    # A SIGKILL at a random step, restarted and bitwise equal to the uninterrupted run, is
    # CI's in tests/e2e/test_resume_chaos.py; here the benchmark's own path: its reference, a
    # faulted run, the bitwise check and the recovery time, on the fault that test lacks.
    out = tmp_path / "chaos.json"
    argv = [sys.executable, str(SCRIPT), "--n", "1", "--faults", "corrupt"]
    argv += ["--configs", "ddp2", "--seed", "1", "--steps", "12", "--interval", "3"]
    argv += ["--dir", str(tmp_path / "runs"), "--json", str(out), "--timeout", "180"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=580)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "chaos: 1/1 runs passed" in done.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["fault"] for r in runs] == ["corrupt"]
    for r in runs:
        assert r["bitwise"] and r["finished"] and r["lost"] == 0, r
        assert r["recovery_s"] is not None and r["recovery_s"] > 0, r
    assert runs[0]["exit_codes"] == [0, 0]  # the run, then the rerun after the corruption
