"""``[fault_tolerance]`` and the per-group configs of ``meshrun launch --replica-groups``:
pure checks, no processes (the processes: tests/e2e/test_ft.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from meshrun.config import Config, ConfigError, load_config, split_overrides
from meshrun.config.fault_tolerance import FaultToleranceConfig, check_lighthouse
from meshrun.data.sampler import ResumableSampler
from meshrun.ft import data_share
from meshrun.ft.data import live_share
from meshrun.launch.replicas import descendants, group_config


def _cfg(*args: str) -> Config:
    return load_config(None, split_overrides(list(args))[0])


def test_off_by_default_and_a_majority_quorum() -> None:
    ft = Config().fault_tolerance
    assert not ft.enabled and ft.replica_groups == 1
    assert FaultToleranceConfig(replica_groups=2).quorum_size() == 2
    assert FaultToleranceConfig(replica_groups=5).quorum_size() == 3
    assert FaultToleranceConfig(replica_groups=5, min_replicas=1).quorum_size() == 1


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["--fault_tolerance.group_index=2", "--fault_tolerance.replica_groups=2"],
            ["fault_tolerance.group_index = 2", "[0, 2)"],
        ),
        (
            ["--fault_tolerance.replica_groups=2", "--fault_tolerance.min_replicas=3"],
            ["fault_tolerance.min_replicas = 3", "0 for a majority"],
        ),
        (["--fault_tolerance.replica_groups=0"], ["fault_tolerance.replica_groups", ">= 1"]),
        (["--fault_tolerance.lighthouse=nohost"], ["fault_tolerance.lighthouse", "HOST:PORT"]),
        (["--fault_tolerance.missing_group=grow"], ["fault_tolerance.missing_group", "shrink"]),
    ],
)
def test_bad_values_name_the_key_and_the_fix(args: list[str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        _cfg(*args)
    for word in words:
        assert word in str(err.value)


def test_lighthouse_address_parses() -> None:
    assert check_lighthouse("10.0.0.1:29510") == ("10.0.0.1", 29510)
    assert check_lighthouse("http://head:1") == ("head", 1)
    with pytest.raises(ConfigError, match="--lighthouse"):
        check_lighthouse("head:0")


def test_each_group_reads_its_own_share_as_plain_data_parallelism_would() -> None:
    ft = FaultToleranceConfig(replica_groups=3, group_index=2)
    assert data_share(ft, dp_rank=1, dp_size=2) == (5, 6)
    assert data_share(FaultToleranceConfig(), dp_rank=1, dp_size=2) == (1, 2)


def test_with_every_group_live_the_share_is_plain_data_parallelism() -> None:
    ft = FaultToleranceConfig(replica_groups=3, group_index=2)
    assert live_share(48, 3, 1, 2, participant=2, live=3) == (*data_share(ft, 1, 2), 48)
    assert live_share(48, 3, 1, 2, participant=0, live=2) == (1, 4, 32)
    with pytest.raises(ValueError, match="participant 2 of 2"):
        live_share(48, 3, 0, 2, participant=2, live=2)


def test_live_groups_cover_the_order_once_whatever_the_quorums() -> None:
    """3 groups x 2 ranks, global batch 24: quorums of 3, 2, 1, 2, 3 live groups (the
    participant indices as torchft ranks them), a step that does not commit, groups that
    rejoin and heal from a peer's sampler state. Every position is read exactly once, in order."""
    groups, dp, batch, n = 3, 2, 24, 1000
    samplers = {
        (g, r): ResumableSampler(
            n, rank=g * dp + r, world_size=groups * dp, global_batch=batch, seed=7
        )
        for g in range(groups)
        for r in range(dp)
    }
    plan = [(0, 1, 2), (0, 2), (2,), (0, 2), (0, 1, 2), (1, 2), (0, 1, 2)]
    trained: list[int] = []
    for k, live in enumerate(plan):
        # A group that rejoins heals from the peer furthest on (ft/heal.py moves the state).
        ahead = max(live, key=lambda g: samplers[g, 0].consumed)
        for g in live:
            for r in range(dp):
                samplers[g, r].load_state_dict(samplers[ahead, r].state_dict())
        step: list[int] = []
        for j, g in enumerate(live):
            for r in range(dp):
                sampler = samplers[g, r]
                sampler.set_share(*live_share(batch, groups, r, dp, j, len(live)))
                step += list(itertools.islice(iter(sampler), batch // groups // dp))
        if k == 5:  # not committed: nothing moves, the same positions are read again
            continue
        trained += step
        for g in live:
            for r in range(dp):
                samplers[g, r].step(len(live) * batch // groups)
    reference = ResumableSampler(n, rank=0, world_size=1, global_batch=1, seed=7)
    consumed = samplers[0, 0].consumed
    assert consumed == len(trained) == 8 * (3 + 2 + 1 + 2 + 3 + 3)
    assert sorted(trained) == sorted(itertools.islice(iter(reference), consumed))
    assert len(set(trained)) == len(trained)


def test_group_config_sets_index_lighthouse_and_its_own_run_dir(tmp_path: Path) -> None:
    cfg = _cfg(f"--job.run_dir={tmp_path}", "--data.global_batch=16", "--data.micro_batch=8")
    g1 = group_config(cfg, 2, 1, "127.0.0.1:9", nproc=1)
    assert g1.fault_tolerance.group_index == 1 and g1.fault_tolerance.replica_groups == 2
    assert g1.fault_tolerance.lighthouse == "127.0.0.1:9"
    assert g1.resolved_run_dir() == tmp_path / "group1"
    assert cfg.fault_tolerance.group_index == 0  # the job's config is left as it was


def test_group_config_is_checked_for_the_groups_world(tmp_path: Path) -> None:
    cfg = _cfg(f"--job.run_dir={tmp_path}", "--parallel.dp_shard=2", "--parallel.zero=3")
    with pytest.raises(ConfigError):
        group_config(cfg, 2, 0, "127.0.0.1:9", nproc=1)  # dp_shard 2 on 1 process


def test_descendants_of_a_process_without_children() -> None:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert proc.pid in descendants(__import__("os").getpid())
        assert descendants(proc.pid) == []
    finally:
        proc.kill()
        proc.wait()
