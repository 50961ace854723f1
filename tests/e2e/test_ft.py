"""Replica-group fault tolerance (torchft) end to end: ``meshrun launch --replica-groups 2``
with its own lighthouse, real torchrun agents, real Gloo processes (2 groups x 1 rank, and
2 groups x 2 ranks under ZeRO-3).

- Without faults the groups train exactly what plain data parallelism over the same 2 ranks
  trains: per-step losses within 1e-5, and (measured) the same final weights.
- SIGKILL of one group's worker at 5 random steps of one run (a seeded RNG, its seed printed;
  ``FT_TEST_SEED`` replays one): the other group's process never restarts (one PID), keeps
  committing steps alone, the job reaches optim.steps, and the restarted group heals from it
  5 times and ends bitwise equal (a checksum each rank writes); each kill breaks exactly the
  step it was planned for. The same with ZeRO-3 inside 2-rank groups: rank r heals its shard
  from rank r of the survivor.
- In every run each sample of the stream the committed steps covered was trained exactly
  once (the dataset indices each rank records per committed step), and the data position
  advanced by the samples the steps trained: the shrunk steps' and the healed group's too.
- A group dying inside the cross-group all-reduce: the survivor does not commit that step
  (Gloo's connection error goes to torchft's Manager) and carries on.
- A stranger is refused (docs/fault_tolerance.md, "Strangers"): while the groups wait before
  step PAUSE's quorum (a file says so; no timing window), this test sends one quorum request
  to the job's lighthouse through torchft's own ``LighthouseClient``, as the stranger of issue
  26 sent it: ``replica_id="stranger_0"``, ``step=100000``, its own addresses, heartbeating
  until its request is answered. At 210a125 the lighthouse put it in a quorum with the real
  groups; they tried to heal from it and to join its store, stalled 60 s, and group 1 died.
  Now each group sees the stranger's id carries no tag of this job, refuses that quorum (an
  ``ft_refused`` event and one warning line naming it), asks again, and both groups train
  every step with the losses, bit for bit, of the same job without a stranger (the run the
  plain-data-parallelism test reads too). While the groups wait, every listening socket of
  the job's processes is listed: none is bound to every interface. (Two hosts:
  tests/e2e/test_ft_trust.py.)

The restarts cost what a torchrun restart costs (torch import: 2-60 s on a loaded 2-core
machine); the worker's test hooks (tests/e2e/scripts/ft_worker.py) make the survivor ask for
its quorum again, after 3 steps alone and before the end, until the restarted group is in it,
so no outcome depends on timing.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import sockets
from meshrun.config import load_config
from meshrun.data.sampler import ResumableSampler

pytestmark = pytest.mark.slow
WORKER = Path(__file__).parent / "scripts" / "ft_worker.py"
STEPS = 24
SAMPLES = 4096  # the worker's dataset
KEYS = ["--data.micro_batch=8", "--data.global_batch=16"]
FT_KEYS = ["--fault_tolerance.min_replicas=1", "--fault_tolerance.heartbeat_timeout_ms=1000"]


def _launch(
    run_dir: Path,
    flags: list[str],
    env: dict[str, str],
    timeout: float,
    *more: str,
    steps: int = STEPS,
) -> str:
    ft = FT_KEYS if "--replica-groups" in flags else []
    base = [] if "--nproc-per-node" in flags else ["--nproc-per-node", "2"]
    cmd = [
        sys.executable,
        "-m",
        "meshrun",
        "launch",
        *base,
        *flags,
        str(WORKER),
        f"--job.run_dir={run_dir}",
        f"--optim.steps={steps}",
        *KEYS,
        *ft,
        *more,
    ]
    proc = subprocess.run(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    tail = proc.stderr[-4000:]
    assert proc.returncode == 0, tail
    return proc.stderr


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(run_dir: Path) -> dict[int, float]:
    """The last logged loss of each step (a restarted group logs its steps again)."""
    rows = _rows(run_dir / "metrics.jsonl")
    return {int(r["step"]): float(r["loss"]) for r in rows if "event" not in r}  # type: ignore[arg-type]


def _events(run_dir: Path, name: str) -> list[dict[str, object]]:
    return [r for r in _rows(run_dir / "metrics.jsonl") if r.get("event") == name]


def _pids(run_dir: Path) -> list[int]:
    return [int(line.split()[1]) for line in (run_dir / "pids.txt").read_text().splitlines()]


def _checksum(run_dir: Path) -> dict[str, object]:
    out: dict[str, object] = json.loads((run_dir / "checksum.rank0.json").read_text())
    return out


def _check_samples(run_dir: Path, groups: list[Path]) -> int:
    """Each dataset index of the stream's first ``consumed`` positions (where the survivor's
    data position ended) was trained exactly once in a committed step, over every rank of
    every group and every process of each, and nothing else was; ``consumed`` is the sum of
    the samples the survivor's committed steps trained. Returns ``consumed``."""
    trained = [
        i
        for g in groups
        for path in sorted(g.glob("samples.rank*.jsonl"))
        for row in _rows(path)
        for i in row["indices"]
    ]  # type: ignore[attr-defined]
    return _check_trained_once(groups, trained)


def _check_trained_once(groups: list[Path], trained: list[int]) -> int:
    """``trained`` (the dataset indices of the committed steps) is the stream's first
    ``consumed`` positions, each once; ``consumed`` is what the survivor's steps trained."""
    consumed = int(_checksum(groups[0])["consumed"])  # type: ignore[call-overload]
    steps = [r for r in _rows(groups[0] / "metrics.jsonl") if "event" not in r]
    assert consumed == sum(int(r["samples"]) for r in steps)  # type: ignore[call-overload]
    twice = {i: n for i, n in Counter(trained).items() if n > 1}
    assert not twice, f"trained more than once: {sorted(twice)[:10]}"
    seed = load_config(groups[0] / "config.toml").job.seed
    order = ResumableSampler(SAMPLES, rank=0, world_size=1, global_batch=1, seed=seed)
    expected = set(itertools.islice(iter(order), consumed))
    assert len(expected) == consumed  # the run stays inside one epoch: indices are distinct
    skipped = sorted(expected - set(trained))
    assert not skipped, f"{len(skipped)} samples skipped: {skipped[:10]}"
    assert set(trained) == expected
    return consumed


def _assert_like_plain(plain_dir: Path, groups: list[Path], steps: int) -> None:
    """Every group logged every step, each loss within 1e-5 of the plain run's (the same
    world without replica groups), and every step had all groups live."""
    plain = _losses(plain_dir)
    assert sorted(plain) == list(range(1, steps + 1))
    for group in groups:
        losses = _losses(group)
        assert sorted(losses) == sorted(plain)
        worst = max(abs(losses[s] - plain[s]) for s in plain)
        print(f"{group.name}: largest loss difference to {plain_dir.name}: {worst:.2e}")
        assert worst <= 1e-5
        live = {r.get("live_groups") for r in _rows(group / "metrics.jsonl") if "event" not in r}
        assert live == {len(groups)}  # every step had every group


GROUP_STEPS = 12  # the plain replica-group run, which two tests read
PAUSE = 5  # the step before whose quorum the stranger's request is sent


def _groups_command(run_dir: Path) -> list[str]:
    launch = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2"]
    job = [str(WORKER), f"--job.run_dir={run_dir}", f"--optim.steps={GROUP_STEPS}"]
    return [*launch, "--replica-groups", "2", *job, *KEYS, *FT_KEYS]


@pytest.fixture(scope="module")
def groups_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 replica groups x 1 rank, no fault (one launch for the module)."""
    run_dir = tmp_path_factory.mktemp("ft")
    done = subprocess.run(
        _groups_command(run_dir),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return run_dir


@pytest.mark.timeout(600)
def test_replica_groups_train_what_plain_data_parallelism_trains(
    groups_run: Path, tmp_path: Path
) -> None:
    _launch(tmp_path / "dp", [], {}, 280, steps=GROUP_STEPS)
    groups = [groups_run / "group0", groups_run / "group1"]
    _assert_like_plain(tmp_path / "dp", groups, GROUP_STEPS)
    # The start-up line's arithmetic spans the groups: 16 = 8 x 1 x 1 x 2.
    started = (groups[0] / "logs" / "rank0.log").read_text()
    assert "global batch 16 = micro 8 x accum 1 x dp 1 x 2 replica groups" in started
    for group in groups:
        assert _checksum(group)["checksum"] == _checksum(tmp_path / "dp")["checksum"]
    assert _check_samples(groups_run, groups) == GROUP_STEPS * 16


def _wait_for(what: str, ready: Any, proc: subprocess.Popen[bytes], log: Path) -> Any:
    deadline = time.monotonic() + 300
    while not (found := ready()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(
                f"{what}: never came (launch rc {proc.poll()})\n" + log.read_text()[-3000:]
            )
        time.sleep(0.1)
    return found


class Stranger:
    """One quorum request to the lighthouse, heartbeating (as a live replica does) until it
    is answered; ``quorum`` is the answer."""

    def __init__(self, lighthouse: str) -> None:
        from torchft._torchft import LighthouseClient

        self.client = LighthouseClient(lighthouse, connect_timeout=timedelta(seconds=10))
        self.quorum: Any = None
        self.error: BaseException | None = None
        self.answered = threading.Event()
        threading.Thread(target=self._ask, daemon=True).start()
        threading.Thread(target=self._beat, daemon=True).start()

    def _ask(self) -> None:
        try:
            self.quorum = self.client.quorum(
                replica_id="stranger_0",
                timeout=timedelta(seconds=200),
                address="http://127.0.0.1:1",
                store_address="127.0.0.1:1",
                step=100000,
                world_size=1,
                shrink_only=False,
            )
        except BaseException as err:  # the test reports it
            self.error = err
        self.answered.set()

    def _beat(self) -> None:
        while not self.answered.wait(0.1):
            self.client.heartbeat("stranger_0")


def _lighthouse(log: Path) -> str | None:
    found = re.search(r"lighthouse on (127\.0\.0\.1:\d+)", log.read_text())
    return f"http://{found.group(1)}" if found else None


def _stranger_waits(lighthouse: str) -> bool:
    """The lighthouse holds the stranger's request as its one participant (the groups,
    paused, have not asked yet)."""
    page = urllib.request.urlopen(f"{lighthouse}/status", timeout=10).read().decode()
    return "[1/1 participants healthy]" in page


@pytest.mark.timeout(900)
def test_a_stranger_quorum_request_is_refused_and_both_groups_train_to_the_end(
    groups_run: Path, tmp_path: Path
) -> None:
    run_dir, log = tmp_path / "attacked", tmp_path / "attacked.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _groups_command(run_dir),
            env={**os.environ, "OMP_NUM_THREADS": "1", "FT_PAUSE_AT": str(PAUSE)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        with sockets.Watch(proc.pid, every_s=0.5) as watch:
            lighthouse = _wait_for("the lighthouse line", lambda: _lighthouse(log), proc, log)
            for g in (0, 1):
                _wait_for(
                    f"group {g} paused", (run_dir / f"group{g}" / "paused.rank0").exists, proc, log
                )
            watch.seen |= sockets.listeners(proc.pid)  # every server is up while they wait
            stranger = Stranger(lighthouse)
            _wait_for("the stranger's request held", lambda: _stranger_waits(lighthouse), proc, log)
            (run_dir / "go").write_text("1")
            assert proc.wait(timeout=400) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()

    assert stranger.answered.wait(30) and stranger.error is None, stranger.error
    ids = [p.replica_id for p in stranger.quorum.participants]
    print("the stranger's quorum:", ids)
    assert "stranger_0" in ids and any(i.startswith("meshrun_group_") for i in ids)
    refused = [e for g in (0, 1) for e in _events(run_dir / f"group{g}", "ft_refused")]
    print("refused:", refused)
    assert refused and all("'stranger_0'" in str(e["reason"]) for e in refused)
    assert all(int(e["step"]) == PAUSE for e in refused)
    assert "carries no valid tag of this job; asking again" in log.read_text()
    for g in (0, 1):
        attacked, clean = _losses(run_dir / f"group{g}"), _losses(groups_run / f"group{g}")
        assert sorted(attacked) == list(range(1, GROUP_STEPS + 1))
        assert attacked == clean, (attacked, clean)  # bit for bit: the same steps, the same data
        checksum = json.loads((run_dir / f"group{g}" / "checksum.rank0.json").read_text())
        assert checksum["step"] == GROUP_STEPS
    print(sockets.describe(watch.seen))
    # The lighthouse (the launcher); per group its agent's store, and in its worker the
    # worker store, the manager server, the heal server and Gloo's listeners.
    assert len({s.port for s in watch.seen}) >= 11, sockets.describe(watch.seen)
    assert not sockets.wildcard(watch.seen), sockets.describe(watch.seen)
    assert {s.address for s in watch.seen} == {"127.0.0.1"}, sockets.describe(watch.seen)


def _kill_steps(rng: random.Random, kills: int, first: int, last: int, gap: int) -> list[int]:
    """``kills`` steps in [first, last], at least ``gap`` apart: room for each restarted
    group to heal (FT_ALONE = 3 quorums alone, then the survivor asks again until it is back)
    and commit a step before the next kill, so each kill lands at its step."""
    slack = last - first - gap * (kills - 1)
    extra = sorted(rng.choices(range(slack + 1), k=kills))
    return [first + gap * i + e for i, e in enumerate(extra)]


def _check_survived(run_dir: Path, kills: int, ranks: int = 1, steps: int = STEPS) -> None:
    """Group 0 never restarted and reached the end; group 1 restarted ``kills`` times, healed
    as often, and ends with group 0's weights, bit for bit (rank by rank: its shards)."""
    survivor, healed = run_dir / "group0", run_dir / "group1"
    assert len(_pids(survivor)) == ranks, _pids(survivor)
    assert _checksum(survivor)["pid"] in _pids(survivor)
    assert len(_pids(healed)) == ranks * (kills + 1)
    for r in range(1, ranks):
        mine = json.loads((survivor / f"checksum.rank{r}.json").read_text())
        theirs = json.loads((healed / f"checksum.rank{r}.json").read_text())
        assert mine["checksum"] == theirs["checksum"] and mine["pid"] in _pids(survivor)
    heals = _events(healed, "ft_heal")
    assert len(heals) == kills, heals
    assert all(h["source"] == "group 0" and int(h["bytes"]) > 0 for h in heals)  # type: ignore[call-overload]
    assert sorted(_losses(survivor)) == list(range(1, steps + 1))
    assert _checksum(survivor)["step"] == _checksum(healed)["step"] == steps
    assert _checksum(survivor)["checksum"] == _checksum(healed)["checksum"]
    assert _checksum(survivor)["consumed"] == _checksum(healed)["consumed"]
    assert len(_events(survivor, "ft_uncommitted")) >= kills  # the step each kill broke
    alone = [
        r
        for r in _rows(survivor / "metrics.jsonl")
        if r.get("live_groups") == 1 and "event" not in r
    ]
    assert alone, "the survivor committed no step while the other group was down"
    # Shrink: a step with one group live trained (and moved the position by) its share only.
    assert {int(r["samples"]) for r in alone} == {8}  # type: ignore[call-overload]
    consumed = _check_samples(run_dir, [survivor, healed])
    assert consumed == 16 * steps - 8 * len(alone)


# Kills per run: 2 in CI, 5 with MESHRUN_HEAVY_TESTS=1 (each costs a restart and a heal).
KILLS = 5 if os.environ.get("MESHRUN_HEAVY_TESTS") else 2


def _repeated_kills(tmp_path: Path, flags: list[str], *more: str, ranks: int = 1) -> None:
    """Group 1 (of 2) killed at ``KILLS`` seeded steps (``FT_TEST_SEED`` replays a seed); each
    kill lands at its step: the survivor logs an uncommitted step there."""
    seed = int(os.environ.get("FT_TEST_SEED") or random.randrange(10**6))
    steps = 7 + 5 * KILLS  # 3 before the first kill, 5 between kills, room to end after (32 for 5)
    kills = _kill_steps(random.Random(seed), KILLS, first=3, last=steps - 6, gap=5)
    print(f"FT_TEST_SEED={seed}: group 1 is killed at steps {kills}")
    env = {"FT_KILL_STEPS": "1:" + ",".join(map(str, kills)), "FT_HOLD_AT": str(steps - 3)}
    flags = [*flags, "--replica-groups", "2", "--max-restarts", str(KILLS + 1)]
    _launch(tmp_path, flags, env, 880, *more, steps=steps)
    _check_survived(tmp_path, kills=KILLS, ranks=ranks, steps=steps)
    broken = [int(e["step"]) for e in _events(tmp_path / "group0", "ft_uncommitted")]  # type: ignore[call-overload]
    assert broken == kills, (broken, kills)


# heavy: a killed group healing from its peer stays in CI (test_ft_layouts.py's TP group)
@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_repeated_kills_five_heals_while_the_other_group_keeps_training(tmp_path: Path) -> None:
    _repeated_kills(tmp_path, [])


@pytest.mark.timeout(600)
def test_a_death_inside_the_all_reduce_leaves_that_step_uncommitted(tmp_path: Path) -> None:
    env = {"FT_KILL_IN_ALLREDUCE": "1:5", "FT_HOLD_AT": str(STEPS - 3)}
    _launch(tmp_path, ["--replica-groups", "2", "--max-restarts", "2"], env, 580)
    _check_survived(tmp_path, kills=1)
    broken = _events(tmp_path / "group0", "ft_uncommitted")
    assert broken[0]["step"] == 5, broken
    assert "Connection" in str(broken[0]["error"]) or "closed" in str(broken[0]["error"])


# heavy (CI's time): a killed group healing both shards from its peer stays in CI
# (test_ft_layouts.py's tensor-parallel group)
@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_two_groups_of_zero3_survive_repeated_kills_healing_shard_by_shard(tmp_path: Path) -> None:
    """2 groups x 2 processes, ZeRO-3 (FSDP2) inside each, KILLS kills: rank r heals from rank r."""
    _repeated_kills(
        tmp_path, ["--nproc-per-node", "4"], "--parallel.zero=3", "--data.micro_batch=4", ranks=2
    )
