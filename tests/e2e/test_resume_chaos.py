"""Elastic restarts with auto-resume, for real: ``meshrun launch --max-restarts 2`` runs the demo
on 2 Gloo workers with a checkpoint every 4 steps, and a worker is SIGKILLed

* from outside, at a random step (the step is printed with the seed that chose it), or
* in the middle of a save (shards written, not committed),

and each time the job finishes by itself with exit code 0, resumed from the newest valid
checkpoint, with final parameters bitwise identical to an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

import meshrun.demo
from meshrun.checkpoint import on_disk

STEPS = 24
INTERVAL = 4
SCRIPTS = Path(__file__).parent / "scripts"
DEMO_CONFIG = Path(meshrun.demo.__file__).with_name("demo.toml")


def launch(
    run_dir: Path,
    target: list[str],
    restarts: int,
    env: dict[str, str] | None = None,
    steps: int = STEPS,
    interval: int = INTERVAL,
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2"]
    argv += ["--config", str(DEMO_CONFIG)]  # the default only for -m meshrun.demo
    argv += ["--max-restarts", str(restarts), *target, "--size", "tiny"]
    argv += ["--corpus-bytes", "300000", f"--job.run_dir={run_dir}", f"--optim.steps={steps}"]
    argv += [f"--checkpoint.interval={interval}", "--metrics.progress=false"]
    argv += ["--job.timeout_s=30"]  # a lost peer is noticed in seconds, not Gloo's 30 min
    run_dir.mkdir(parents=True, exist_ok=True)
    out = open(run_dir / "launcher.log", "wb")  # noqa: SIM115 (closed with the process)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=full_env)


def final_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    path = on_disk.step_dir(run_dir / "checkpoints", STEPS)
    assert on_disk.problems(path) == [], f"final checkpoint {path} invalid"
    flat, _ = flatten_state_dict(_load_state_dict_from_keys(checkpoint_id=str(path)))
    return flat


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    proc = launch(run_dir, ["-m", "meshrun.demo"], restarts=0)
    assert proc.wait(timeout=240) == 0, (run_dir / "launcher.log").read_text()[-3000:]
    return final_tensors(run_dir)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def worker_pid(launcher: int, local_rank: int) -> int | None:
    for pid in descendants(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={local_rank}".encode() in env and b"TORCHELASTIC_RUN_ID=meshrun" in env:
            return pid
    return None


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(line.startswith('{"step"') for line in lines)  # not the summary record


@pytest.mark.timeout(300)
def test_sigkill_at_random_step_restarts_and_matches_uninterrupted_run(
    reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    seed = random.randrange(1 << 30)
    kill_after = random.Random(seed).randrange(INTERVAL + 1, STEPS - 2)
    print(f"chaos seed {seed}: SIGKILL local rank 1 once {kill_after} steps are logged")
    proc = launch(tmp_path, ["-m", "meshrun.demo"], restarts=2)
    deadline = time.monotonic() + 180
    while steps_logged(tmp_path) < kill_after:
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before the kill"
        time.sleep(0.005)
    victim = worker_pid(proc.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    killed_at = steps_logged(tmp_path)
    assert proc.wait(timeout=240) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    log = (tmp_path / "launcher.log").read_text()
    assert "resumed from" in log, log[-3000:]
    print(f"killed at about step {killed_at}; {log.count('resumed from')} resume(s)")
    assert_bitwise_equal(final_tensors(tmp_path), reference)


@pytest.mark.timeout(300)
def test_killed_during_save_resumes_previous_checkpoint(
    reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    kill_at = 3 * INTERVAL
    env = {"KILL_IN_SAVE_AT": str(kill_at), "KILL_MARKER": str(tmp_path / "killed.txt")}
    proc = launch(tmp_path, [str(SCRIPTS / "demo_killed_in_save.py")], restarts=2, env=env)
    assert proc.wait(timeout=240) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    assert (tmp_path / "killed.txt").exists()
    log = (tmp_path / "launcher.log").read_text()
    previous = on_disk.step_dir(tmp_path / "checkpoints", kill_at - INTERVAL)
    assert f"resumed from {previous} (step {kill_at - INTERVAL}" in log, log[-3000:]
    assert_bitwise_equal(final_tensors(tmp_path), reference)


@pytest.mark.timeout(180)
def test_sigterm_to_launcher_saves_current_step_and_exits(tmp_path: Path) -> None:
    proc = launch(tmp_path, ["-m", "meshrun.demo"], restarts=0, steps=5000, interval=5000)
    deadline = time.monotonic() + 120
    while steps_logged(tmp_path) < 5:
        assert proc.poll() is None and time.monotonic() < deadline, "run ended too early"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    log = (tmp_path / "launcher.log").read_text()
    [saved] = on_disk.list_checkpoints(tmp_path / "checkpoints")
    print(f"SIGTERM -> exit {code}; checkpoint of step {saved.step}")
    assert code == 128 + signal.SIGTERM, log[-3000:]  # the documented code of `meshrun launch`
    # Ended by the save, not by torchrun's SIGKILL of the workers 30 s after the signal.
    assert "ending it with SIGKILL" not in log, log[-3000:]
    assert "preempted (SIGTERM)" in log, log[-3000:]
    assert on_disk.problems(saved.path) == []
    assert saved.step >= 5 and saved.step == steps_logged(tmp_path)
