"""Replica groups (torchft) around layouts and tiers that tests/e2e/test_ft.py does not run:
pipeline parallelism inside each group, and the node-local checkpoint tier.

- 2 groups x 2 processes, ``--parallel.pp=2`` inside each (the demo GPT in 2 stages through
  ``run.pipeline``; tests/e2e/scripts/ft_pp_worker.py): without faults the per-step losses are
  those of plain PP 2 x DP 2 on 4 processes (the data-parallel dim is across the groups) and
  both groups end bitwise equal stage by stage. One SIGKILL of group 1's first stage: group
  0's two processes keep their PIDs, group 1 restarts and heals both stages from the same
  ranks of group 0, and every rank ends bitwise equal to its peer; each sample of the covered
  stream trained once (both stages of a group read the same micro-batches: their records
  must agree, and the first stage's count).
- 2 groups x 2 processes, ``--parallel.tp=2`` inside each (the demo GPT through
  ``run.parallelize`` and its TP plan; ft_pp_worker.py without ``parallel.pp``): without
  faults the per-step losses are those of plain TP 2 x FSDP2 2 on 4 processes (meshrun runs
  data parallelism with TP as FSDP2; here the data-parallel dim is across the groups), and
  one SIGKILL of group 1's rank 0 heals both TP shards from the same ranks of group 0.
- 2 groups x 2 processes, ZeRO-1 (``--parallel.zero=1``, ft_worker.py's MLP with
  ``run.optimizer``) inside each: losses as plain ZeRO-1 on 4 processes; after one SIGKILL
  each rank of group 1 heals its own partition of the optimizer state from the same rank of
  group 0 (``ZeroRedundancyOptimizer.state_dict()`` holds no state before a consolidation:
  ft/heal.py sends the partition).
- ``checkpoint.local_interval`` with 2 groups x 1 (ft_worker.py with ``run.resume``): a killed
  group restores its own node-local snapshot (not the shared checkpoint), then heals from the
  live group anyway (its snapshot is behind it) and ends bitwise equal to it; a new launch of
  the same run restores both groups from their own snapshots.

The launch and check helpers are test_ft.py's.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import test_ft
from test_ft import (
    _assert_like_plain,
    _check_trained_once,
    _checksum,
    _events,
    _launch,
    _pids,
    _rows,
)

pytestmark = pytest.mark.slow
PP_WORKER = Path(__file__).parent / "scripts" / "ft_pp_worker.py"
PP = ["--nproc-per-node", "4"]
PP_KEYS = ["--parallel.pp=2", "--data.micro_batch=4"]
ZERO1_KEYS = ["--parallel.zero=1", "--data.micro_batch=4"]
STEPS = 16


def _stage_records(group: Path) -> list[dict[str, object]]:
    """Rank 0's records of committed steps, after checking that rank 1 recorded the same
    steps with the same indices (one pipeline, or one TP pair, reads one batch)."""
    first, second = (_rows(group / f"samples.rank{r}.jsonl") for r in (0, 1))
    keys = [
        [(row["step"], tuple(row["indices"])) for row in rows]  # type: ignore[arg-type]
        for rows in (first, second)
    ]
    assert Counter(keys[0]) == Counter(keys[1]), group
    return first


def _check_pp_samples(groups: list[Path]) -> int:
    """test_ft._check_samples over pipelines (or TP pairs): every index of the stream's first
    ``consumed`` positions trained exactly once in a committed step, counted on rank 0."""
    trained = [i for g in groups for row in _stage_records(g) for i in row["indices"]]  # type: ignore[attr-defined]
    return _check_trained_once(groups, trained)


def _rank_sums(group: Path) -> list[str]:
    return [json.loads((group / f"checksum.rank{r}.json").read_text())["checksum"] for r in (0, 1)]


# heavy (CI's time): replica groups train what plain data parallelism trains in CI (test_ft.py),
# pipelines in tests/dist/test_layouts_pp.py
@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_pipeline_inside_replica_groups_trains_what_plain_pp_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(test_ft, "WORKER", PP_WORKER)
    _launch(tmp_path / "pp", PP, {}, 280, *PP_KEYS, steps=STEPS)
    _launch(tmp_path / "ft", [*PP, "--replica-groups", "2"], {}, 280, *PP_KEYS, steps=STEPS)
    groups = [tmp_path / "ft" / f"group{g}" for g in (0, 1)]
    _assert_like_plain(tmp_path / "pp", groups, STEPS)  # plain PP 2 x DP 2
    assert _rank_sums(groups[0]) == _rank_sums(groups[1])
    assert _check_pp_samples(groups) == STEPS * 16


def _kill_one_of_two(run_dir: Path, kill: int, *keys: str, lost: int = 1) -> None:
    """One launch of 2 groups x 2 ranks reading one batch per group (PP stages, TP ranks)
    where group ``lost``'s rank 0 dies at step ``kill``: the other group's two processes keep
    their PIDs, that step does not commit on them, and they record the steps they take alone
    (``live_groups`` 1: group 0 is no special writer); the lost group restarts both and heals
    both ranks from the same ranks of its peer, every rank ends bitwise equal to its peer,
    each sample once."""
    env = {"FT_KILL_STEPS": f"{lost}:{kill}", "FT_HOLD_AT": str(STEPS - 3)}
    flags = [*PP, "--replica-groups", "2", "--max-restarts", "2"]
    _launch(run_dir, flags, env, 580, *keys, steps=STEPS)
    survivor, healed = run_dir / f"group{1 - lost}", run_dir / f"group{lost}"
    assert len(_pids(survivor)) == 2 and len(_pids(healed)) == 4  # one restart of 2 ranks
    for group in (survivor, healed):
        for r in (0, 1):
            out = json.loads((group / f"checksum.rank{r}.json").read_text())
            assert out["pid"] in _pids(group) and out["step"] == STEPS
            assert out["consumed"] == _checksum(survivor)["consumed"]
    first = {int(line.split()[1]) for line in (survivor / "pids.txt").read_text().splitlines()}
    assert {
        json.loads((survivor / f"checksum.rank{r}.json").read_text())["pid"] for r in (0, 1)
    } == first
    assert _rank_sums(survivor) == _rank_sums(healed)
    heals = _events(healed, "ft_heal")
    assert len(heals) == 1 and heals[0]["source"] == f"group {1 - lost}", heals
    # Both ranks healed: each rank's own log says from whom (rank 1's state came from
    # the survivor's rank 1: its checksum above).
    for r in (0, 1):
        assert f"healed from group {1 - lost}" in (healed / "logs" / f"rank{r}.log").read_text()
    broken = [int(e["step"]) for e in _events(survivor, "ft_uncommitted")]  # type: ignore[call-overload]
    assert broken[0] == kill, broken
    alone = [
        r
        for r in _rows(survivor / "metrics.jsonl")
        if r.get("live_groups") == 1 and "event" not in r
    ]
    assert alone and {int(r["samples"]) for r in alone} == {8}  # type: ignore[call-overload]
    assert _check_pp_samples([survivor, healed]) == 16 * STEPS - 8 * len(alone)


@pytest.mark.heavy  # a heal of a sharded group is shown in CI by the tensor-parallel one
@pytest.mark.timeout(600)
def test_a_killed_pipeline_group_heals_both_stages_from_its_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(test_ft, "WORKER", PP_WORKER)
    _kill_one_of_two(tmp_path, 5, *PP_KEYS)


# heavy: replica groups training like plain DP stay in CI (test_ft.py); TP: the killed TP group
@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_tensor_parallel_inside_replica_groups_trains_what_plain_tp_x_fsdp_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(test_ft, "WORKER", PP_WORKER)
    _launch(tmp_path / "tp", PP, {}, 280, "--parallel.tp=2", "--parallel.zero=3", steps=STEPS)
    _launch(
        tmp_path / "ft", [*PP, "--replica-groups", "2"], {}, 280, "--parallel.tp=2", steps=STEPS
    )
    groups = [tmp_path / "ft" / f"group{g}" for g in (0, 1)]
    _assert_like_plain(tmp_path / "tp", groups, STEPS)  # TP 2 x FSDP2 2 on 4 processes
    assert _rank_sums(groups[0]) == _rank_sums(groups[1])
    assert _check_pp_samples(groups) == STEPS * 16


@pytest.mark.timeout(600)
def test_a_killed_tensor_parallel_group_heals_both_shards_from_its_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(test_ft, "WORKER", PP_WORKER)
    # Group 0 is lost: group 1 trains alone and records it (live_groups 1) in its own metrics.
    _kill_one_of_two(tmp_path, 5, "--parallel.tp=2", lost=0)


# heavy: replica groups training like plain DP stay in CI (test_ft.py)
@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_zero1_inside_replica_groups_trains_what_plain_zero1_trains(tmp_path: Path) -> None:
    _launch(tmp_path / "zero1", PP, {}, 280, *ZERO1_KEYS, steps=STEPS)
    _launch(tmp_path / "ft", [*PP, "--replica-groups", "2"], {}, 280, *ZERO1_KEYS, steps=STEPS)
    groups = [tmp_path / "ft" / f"group{g}" for g in (0, 1)]
    _assert_like_plain(tmp_path / "zero1", groups, STEPS)  # ZeRO-1 over 4 processes
    assert _rank_sums(groups[0]) == _rank_sums(groups[1])
    assert test_ft._check_samples(tmp_path / "ft", groups) == STEPS * 16


@pytest.mark.heavy  # per-rank heals run in CI in test_ft.py's ZeRO-3 groups
@pytest.mark.timeout(600)
def test_a_killed_zero1_group_heals_each_ranks_optimizer_partition(tmp_path: Path) -> None:
    """Group 1's two ranks each load their own partition of the optimizer state from the
    same rank of group 0; with a missing or wrong partition (fresh AdamW moments on the
    parameters that rank owns) the weights would part from group 0's at the next step."""
    kill = 5
    env = {"FT_KILL_STEPS": f"1:{kill}", "FT_HOLD_AT": str(STEPS - 3)}
    flags = [*PP, "--replica-groups", "2", "--max-restarts", "2"]
    _launch(tmp_path, flags, env, 580, *ZERO1_KEYS, steps=STEPS)
    test_ft._check_survived(tmp_path, kills=1, ranks=2, steps=STEPS)
    broken = [int(e["step"]) for e in _events(tmp_path / "group0", "ft_uncommitted")]  # type: ignore[call-overload]
    assert broken[0] == kill, broken
    for r in (0, 1):
        log = (tmp_path / "group1" / "logs" / f"rank{r}.log").read_text()
        assert "healed from group 0" in log


# heavy (CI's time): the local tier's restores run in CI in test_resume_chaos.py, healing in
# test_ft.py
@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_a_killed_group_with_the_local_tier_restores_it_then_heals_from_its_peer(
    tmp_path: Path,
) -> None:
    """2 x 1, a node-local snapshot every 2 steps (no shared checkpoints): group 1 killed in
    step 7 restores its own step-6 snapshot, then heals from group 0, which is ahead."""
    env = {"FT_KILL_STEPS": "1:7", "FT_HOLD_AT": str(STEPS - 3), "FT_RESUME": "1"}
    flags = ["--replica-groups", "2", "--max-restarts", "2"]
    keep = "--checkpoint.local_keep=true"  # the second launch restores the first's snapshots
    _launch(tmp_path, flags, env, 580, "--checkpoint.local_interval=2", keep, steps=STEPS)
    test_ft._check_survived(tmp_path, kills=1, steps=STEPS)
    restores = [(e["tier"], e["step"]) for e in _events(tmp_path / "group1", "restore")]
    assert restores == [("local", 6)], restores
    heal = _events(tmp_path / "group1", "ft_heal")[0]
    assert int(heal["step"]) > 6, heal  # type: ignore[call-overload]
    assert not _events(tmp_path / "group0", "restore")  # the survivor never restarted
    # The same command again (its lighthouse on another port): both groups restore their own
    # step-16 snapshots (nothing is left to train). With the port in the snapshots' config
    # digest they found none and started again from step 0.
    before = _checksum(tmp_path / "group0")
    tier = ("--checkpoint.local_interval=2", keep)
    _launch(tmp_path, flags, {"FT_RESUME": "1"}, 280, *tier, steps=STEPS)
    for g in (0, 1):
        restores = [(e["tier"], e["step"]) for e in _events(tmp_path / f"group{g}", "restore")]
        assert restores and restores[-1] == ("local", STEPS), (g, restores)
        again = _checksum(tmp_path / f"group{g}")
        assert (again["step"], again["checksum"]) == (STEPS, before["checksum"]), again


# heavy (CI's time): healing from a peer group runs in CI in test_ft.py and
# test_a_killed_tensor_parallel_group_heals_both_shards_from_its_peer
@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_groups_resumed_at_different_steps_heal_the_one_behind(tmp_path: Path) -> None:
    """The whole job again after both groups stopped, group 1's newest checkpoint lost: group 0
    resumes step 12 and group 1 step 8 (each from its own checkpoints); the first quorum
    heals group 1 from group 0 (torchft's step is the resumed one), and both end bitwise
    equal. With torchft counting from 0 in both, neither would heal: they would train apart."""
    flags = ["--replica-groups", "2"]
    keys = ["--checkpoint.interval=4", "--checkpoint.keep_last=5"]
    _launch(tmp_path, flags, {"FT_RESUME": "1"}, 280, *keys, steps=12)
    lost = tmp_path / "group1" / "checkpoints" / "step_00000012"
    assert lost.is_dir()
    shutil.rmtree(lost)
    _launch(tmp_path, flags, {"FT_RESUME": "1"}, 280, *keys, steps=STEPS)
    resumed = [e["from_step"] for g in (0, 1) for e in _events(tmp_path / f"group{g}", "resume")]
    assert resumed == [12, 8], resumed
    heals = _events(tmp_path / "group1", "ft_heal")
    assert [(h["source"], h["step"]) for h in heals] == [("group 0", 12)], heals
    survivor, healed = _checksum(tmp_path / "group0"), _checksum(tmp_path / "group1")
    assert survivor["step"] == healed["step"] == STEPS
    assert survivor["checksum"] == healed["checksum"]
    assert survivor["consumed"] == healed["consumed"] == STEPS * 16
