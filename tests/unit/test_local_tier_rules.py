"""The node-local checkpoint tier's pure parts, without processes: the peer mapping, the choice
of the step every rank can restore (and the reason when none), retention, the atomic write and
the shard file format, and the refusal of bad ``checkpoint.local_*`` values."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from meshrun.checkpoint.local.files import decode, encode, scan, to_local, write_atomically
from meshrun.checkpoint.local.rules import (
    Held,
    choose_step,
    history_name,
    replica_peer,
    replica_source,
    shard_name,
    stale_steps,
    step_name,
    superseded,
)
from meshrun.config import CheckpointConfig, ConfigError

H = history_name(4, "abc123")


def test_each_rank_replicates_to_the_same_local_rank_of_the_next_node() -> None:
    # 3 nodes of 2 ranks: node 0 -> node 1 -> node 2 -> node 0
    assert [replica_peer(r, 6, 2) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [replica_source(replica_peer(r, 6, 2) or 0, 6, 2) for r in range(6)] == list(range(6))
    assert replica_peer(1, 4, 4) is None and replica_source(1, 4, 4) is None  # one node: none


def held(rank_files: dict[int, list[tuple[int, int]]], history: str = H) -> list[list[Held]]:
    """``{rank: [(step, shard), ...]}`` -> what each of 4 ranks sees."""
    return [[Held(history, s, sh) for s, sh in rank_files.get(r, [])] for r in range(4)]


def test_newest_step_with_every_shard_somewhere_is_chosen_own_node_first() -> None:
    # step 6: rank 3's node lost it (replaced), rank 1's node keeps its replica; step 8: rank 2
    # was killed while writing, nobody has its shard.
    files = {
        0: [(6, 0), (6, 3), (8, 0)],
        1: [(6, 1), (6, 3), (8, 1)],
        2: [(6, 2), (6, 1)],
        3: [],
    }
    choice = choose_step(held(files), 4, H, shared_newest=4)
    assert choice.step == 6
    assert choice.sources == {0: 0, 1: 1, 2: 2, 3: 0}  # the lowest holder for a lost shard
    assert choice.fetched() == [3]


def test_no_local_restore_when_the_shared_checkpoint_is_as_new_or_nothing_fits() -> None:
    files = {r: [(6, r)] for r in range(4)}
    assert choose_step(held(files), 4, H, shared_newest=6).step is None
    assert "shared checkpoint (step 6)" in choose_step(held(files), 4, H, 6).reason
    assert choose_step(held(files), 4, H, shared_newest=None).step == 6
    partial = {r: [(6, r)] for r in range(3)}
    assert "step 6 lacks [3]" in choose_step(held(partial), 4, H, None).reason
    assert choose_step(held({}), 4, H, None).reason == "no node-local snapshot found"


def test_world_size_or_config_change_makes_the_tier_unusable_with_a_reason() -> None:
    other_world = held({r: [(6, r)] for r in range(4)}, history=history_name(8, "abc123"))
    reason = choose_step(other_world, 4, H, None).reason
    assert "world of 8 ranks, this run has 4" in reason
    other_config = held({r: [(6, r)] for r in range(4)}, history=history_name(4, "fff000"))
    assert "another config" in choose_step(other_config, 4, H, None).reason


def test_retention_keeps_the_newest_and_the_one_before() -> None:
    assert stale_steps([2, 4, 6, 8], 8) == {2, 4}
    assert stale_steps([8], 8) == set()
    assert stale_steps([2, 4, 30], 4) == {30}  # a later step of a history not continued
    assert superseded([2, 4, 6], 4) == {6} and superseded([2, 4], 0) == {2, 4}


def test_atomic_write_leaves_the_previous_file_when_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / H / step_name(6) / shard_name(1)
    write_atomically(path, b"good")

    def crash(*_: object) -> None:
        raise OSError("killed mid-write")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        write_atomically(path, b"torn")
    assert path.read_bytes() == b"good"
    assert scan(tmp_path) == [Held(H, 6, 1)]  # the temporary file is not a shard


def test_shard_file_holds_tensors_and_json_and_loads_weights_only(tmp_path: Path) -> None:
    big = torch.arange(10.0)
    tensors = {"model": {"w": big[2:5]}, "optim": {"state": {"w": {"exp_avg": torch.ones(2)}}}}
    local = to_local(tensors)
    assert local["model"]["w"].untyped_storage().nbytes() == 3 * 4  # the view was copied out
    write_atomically(tmp_path / "s.pt", encode(local, {"step": 6, "sampler": {"consumed": 48}}))
    got, meta = decode(tmp_path / "s.pt")
    assert torch.equal(got["model"]["w"], big[2:5]) and meta["sampler"] == {"consumed": 48}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"local_interval": -1}, "checkpoint.local_interval = -1 is out of range"),
        (
            {"local_dir": "shm/x"},
            "checkpoint.local_dir = 'shm/x' is not allowed: expected an absolute",
        ),
        ({"local_dir": "/dev/shm/{rank}"}, "the only placeholder is '{node}'"),
        ({"local_dir": "/c", "dir": "/c"}, "is checkpoint.dir"),
        ({"local_interval": 8, "interval": 8}, "local_interval must be below interval"),
        ({"local_ranks_per_node": -2}, "checkpoint.local_ranks_per_node = -2 is out of range"),
    ],
)
def test_bad_local_tier_values_are_refused(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        CheckpointConfig(**values)  # type: ignore[arg-type]


def test_good_local_tier_values_are_taken() -> None:
    cfg = CheckpointConfig(local_interval=10, interval=100, local_dir="/dev/shm/m/node{node}")
    assert (cfg.local_interval, cfg.local_ranks_per_node) == (10, 0)
    assert CheckpointConfig(local_interval=5).interval == 0  # no shared interval: any local one
