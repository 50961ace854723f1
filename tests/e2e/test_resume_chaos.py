"""Elastic restarts with auto-resume, for real: ``meshrun launch --max-restarts 2`` runs the demo
on 2 Gloo workers with a checkpoint every 4 steps, and a worker is SIGKILLed

* in the middle of a save (shards written, not committed): the restart resumes from the
  checkpoint before it, and then
* from outside, at a random step of the restarted group (the step is printed with the seed
  that chose it),

and the job finishes by itself with exit code 0, resumed each time from the newest valid
checkpoint, with final parameters bitwise identical to an uninterrupted run. SIGTERM to the
launcher saves the current step and exits with the documented code.

The node-local checkpoint tier through the same restarts: each of the 2 workers its own
simulated node (``checkpoint.local_ranks_per_node = 1``, ``local_dir`` per ``{node}``), a
node-local snapshot every 2 steps and a shared checkpoint every 8. Rank 1 SIGKILLs itself
twice (tests/e2e/scripts/demo_local_tier_killed.py):

* after step 11: the restart restores step 10 from the local tier (the shared one has step 8),
  each rank from its own node;
* after step 19, its node's local directory wiped first (a replaced node): the restart restores
  step 18, rank 1's shard from the replica rank 0's node kept.

The per-step losses of that whole run are bitwise those of the uninterrupted run (without the
tier; one reference run serves every test here: a checkpoint's interval changes no loss).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
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
    extra: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2"]
    argv += ["--config", str(DEMO_CONFIG)]  # the default only for -m meshrun.demo
    argv += ["--max-restarts", str(restarts), *target, "--size", "tiny"]
    argv += ["--corpus-bytes", "300000", f"--job.run_dir={run_dir}", f"--optim.steps={steps}"]
    argv += [f"--checkpoint.interval={interval}", "--metrics.progress=false"]
    argv += ["--job.timeout_s=30", *extra]  # a lost peer is noticed in seconds, not Gloo's 30 min
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
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (one launch for the module)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    proc = launch(run_dir, ["-m", "meshrun.demo"], restarts=0)
    assert proc.wait(timeout=240) == 0, (run_dir / "launcher.log").read_text()[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def reference(reference_dir: Path) -> dict[str, torch.Tensor]:
    return final_tensors(reference_dir)


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


def wait_until(done: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 180
    while not done():
        assert proc.poll() is None and time.monotonic() < deadline, f"run ended before {what}"
        time.sleep(0.005)


@pytest.mark.timeout(420)
def test_killed_in_a_save_then_at_a_random_step_resumes_each_time_like_the_uninterrupted_run(
    reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    kill_at = 3 * INTERVAL
    marker = tmp_path / "killed.txt"
    env = {"KILL_IN_SAVE_AT": str(kill_at), "KILL_MARKER": str(marker)}
    proc = launch(tmp_path, [str(SCRIPTS / "demo_killed_in_save.py")], restarts=2, env=env)
    wait_until(marker.exists, proc, "the kill in the save")
    # Rank 0 (it writes the step records) dies right after the marker: every later record is
    # the restarted group's, which trains steps 9-24 (16 records).
    logged = steps_logged(tmp_path)
    seed = random.randrange(1 << 30)
    more = random.Random(seed).randrange(2, STEPS - 2 * INTERVAL - 1)
    print(f"chaos seed {seed}: SIGKILL local rank 1 once {more} more steps are logged")
    wait_until(lambda: steps_logged(tmp_path) >= logged + more, proc, "the kill")
    victim = worker_pid(proc.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    killed_at = steps_logged(tmp_path)
    assert proc.wait(timeout=240) == 0, (tmp_path / "launcher.log").read_text()[-3000:]
    log = (tmp_path / "launcher.log").read_text()
    previous = on_disk.step_dir(tmp_path / "checkpoints", kill_at - INTERVAL)
    # The save of step 12 never committed: the first restart resumed from step 8.
    assert f"resumed from {previous} (step {kill_at - INTERVAL}" in log, log[-3000:]
    assert log.count("; restart ") == 2, log[-3000:]  # then the random kill's restart
    print(f"killed at about step record {killed_at}; {log.count('resumed from')} resume line(s)")
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


def losses(run_dir: Path) -> dict[int, float]:
    """The loss of each step, its last record (a redone step is logged again)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row and "loss" in row:
            out[row["step"]] = row["loss"]
    return out


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_restarts_restore_from_local_tier_and_from_a_peer_with_bitwise_losses(
    reference_dir: Path, tmp_path: Path
) -> None:
    run, local = tmp_path / "killed", tmp_path / "local"
    tier = ["--checkpoint.local_interval=2", "--checkpoint.local_ranks_per_node=1"]
    tier.append(f"--checkpoint.local_dir={local}/node{{node}}")
    markers = f"{tmp_path}/kill1,{tmp_path}/kill2"
    env = {"KILL_AFTER": "11,19", "KILL_MARKER": markers, "WIPE": "0,1"}
    env["WIPE_LOCAL_DIR"] = str(local / "node1")
    target = [str(SCRIPTS / "demo_local_tier_killed.py")]
    proc = launch(run, target, restarts=2, env=env, interval=8, extra=tuple(tier))
    log_path = run / "launcher.log"
    assert proc.wait(timeout=240) == 0, log_path.read_text()[-3000:]
    log = log_path.read_text()
    assert log.count("; restart ") == 2 and "wiped 1" in (tmp_path / "kill2").read_text()
    said = [line.split("meshrun: ", 1)[1] for line in log.splitlines() if "restored from" in line]
    assert len(said) == 2, log[-3000:]
    assert said[0].startswith("restored from the node-local tier: step 10 (every rank from its own")
    assert said[1].startswith(
        "restored from the node-local tier: step 18 (1 rank(s) [1] from a peer"
    )
    assert "resumed from" not in log  # the shared checkpoint (step 8, 16) was not loaded
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    restores = [(e["tier"], e["step"], e["fetched"]) for e in events if e.get("event") == "restore"]
    assert restores == [("local", 10, []), ("local", 18, [1])]
    ref, got = losses(reference_dir), losses(run)
    # Bitwise: the floats compared exactly.
    assert sorted(got) == list(range(1, STEPS + 1)) and got == ref
