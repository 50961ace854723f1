"""Under replica groups the layout is each group's and the global batch is every group's:
``meshrun launch --replica-groups N`` checks the layout against nproc-per-node / N processes,
a launch that is one group of ``fault_tolerance.replica_groups`` against its own world, and an
unset global batch becomes micro-batch x one group's data-parallel size x the groups (the
number each group's workers divide by: ``train/startup.py`` accumulates over dp x groups)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import meshrun.launch.agent.local
from meshrun.cli.main import main
from meshrun.config import ConfigError, grad_accumulation, load_config, validate_for_world
from meshrun.launch.prepare import prepare
from meshrun.launch.spec import parse_nnodes

pytestmark = pytest.mark.timeout(30)

HSDP_PER_GROUP = ["--parallel.zero=3", "--parallel.dp_replicate=2", "--parallel.dp_shard=2"]


def _launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, groups: int, *keys: str, flags: str = ""
) -> tuple[int, list[Any]]:
    """``meshrun launch --replica-groups GROUPS --nproc-per-node 8 FLAGS``: its exit code and
    the specs it handed to the process launcher (replaced here: nothing is started)."""
    script = tmp_path / "train.py"
    script.write_text("")
    specs: list[Any] = []
    monkeypatch.setattr(
        meshrun.launch.agent.local, "launch_local", lambda spec: specs.append(spec) or 0
    )
    argv = ["launch", "--replica-groups", str(groups), "--nproc-per-node", "8", *flags.split()]
    return main([*argv, str(script), f"--job.run_dir={tmp_path / 'run'}", *keys]), specs


def test_replica_groups_check_the_layout_per_group_and_count_the_groups_in_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, specs = _launch(tmp_path, monkeypatch, 2, *HSDP_PER_GROUP)
    assert code == 0
    (spec,) = specs
    assert (spec.procs_per_node, spec.replica_groups) == (8, 2)
    written = load_config(spec.config_path)
    assert written.fault_tolerance.replica_groups == 2
    assert written.data.global_batch == 8 * 4 * 2  # micro x dp of a group of 4 x 2 groups
    err = capsys.readouterr().err
    assert "8 x 4 x 2 = 64 (micro_batch x data-parallel size per group x replica groups)" in err
    dims = validate_for_world(written, 4)  # each group's workers check their own world
    assert (dims["dp_replicate"], dims["dp_shard"]) == (2, 2)
    assert grad_accumulation(written.data, 4 * 2) == 1


def test_replica_groups_that_do_not_divide_the_processes_stop_before_any_spawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, specs = _launch(tmp_path, monkeypatch, 3)
    assert code != 0
    assert specs == []
    err = capsys.readouterr().err
    assert "--replica-groups 3 does not divide --nproc-per-node 8" in err


def test_one_launch_per_group_derives_the_same_global_batch_as_every_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = [("fault_tolerance.replica_groups", "4"), ("fault_tolerance.group_index", "1")]
    cfg = load_config(None, [*keys, ("job.run_dir", str(tmp_path))])
    written = load_config(prepare(cfg, 2, parse_nnodes("1")))  # this group: 2 processes, dp 2
    assert written.data.global_batch == 8 * 2 * 4
    assert "8 x 2 x 4 = 64" in capsys.readouterr().err
    assert grad_accumulation(written.data, 2 * 4) == 1  # what the group's workers divide by


def test_a_set_global_batch_must_divide_over_every_groups_ranks() -> None:
    keys = [("fault_tolerance.replica_groups", "2"), ("data.micro_batch", "4")]
    cfg = load_config(None, [*keys, ("data.global_batch", "24")])
    with pytest.raises(ConfigError) as info:
        validate_for_world(cfg, 2)
    message = str(info.value)
    assert "data.global_batch = 24 is not divisible by micro_batch x" in message
    assert "(data-parallel size 2 per group x 2 replica groups)" in message


def test_replica_groups_on_several_nodes_stop_before_any_spawn_naming_the_way_across_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = "--nnodes 2 --node-rank 0 --rdzv-endpoint 127.0.0.1:29411"
    code, specs = _launch(tmp_path, monkeypatch, 2, flags=flags)
    assert code != 0
    assert specs == []
    err = capsys.readouterr().err
    assert "--replica-groups starts every group on this node, but --nnodes is '2'" in err
    assert "--fault_tolerance.group_index=G" in err
    assert "Traceback" not in err


def test_keys_that_need_the_groups_are_checked_against_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # min_replicas = 2 is valid with two groups: the flag's count is recorded before the keys
    # are checked (it was refused as "exceeds fault_tolerance.replica_groups = 1").
    code, specs = _launch(tmp_path, monkeypatch, 2, "--fault_tolerance.min_replicas=2")
    assert code == 0
    (spec,) = specs
    assert load_config(spec.config_path).fault_tolerance.min_replicas == 2
