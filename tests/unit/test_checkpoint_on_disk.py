"""The pure part of checkpoints: naming, manifest validation, retention, the tensor/JSON split
and RNG capture. No processes."""

import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from meshrun.checkpoint import on_disk
from meshrun.checkpoint.state import (
    StateError,
    capture_rng,
    merge_state,
    restore_rng,
    split_state,
)


def make_checkpoint(root: Path, step: int) -> Path:
    tmp = on_disk.tmp_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (tmp / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data={})))
    final = on_disk.step_dir(root, step)
    manifest = on_disk.build_manifest(tmp, step=step, meta={"world_size": 2})
    on_disk.commit_dir(tmp, final, manifest)
    return final


def test_names_sort_by_step_and_tmp_dirs_are_not_checkpoints(tmp_path: Path) -> None:
    assert on_disk.parse_step(on_disk.step_dir(tmp_path, 120).name) == 120
    assert on_disk.parse_step(on_disk.tmp_dir(tmp_path, 120).name) is None
    for step in (100, 20, 3):
        make_checkpoint(tmp_path, step)
    on_disk.tmp_dir(tmp_path, 200).mkdir()  # a save that was killed
    assert [c.step for c in on_disk.list_checkpoints(tmp_path)] == [3, 20, 100]


def test_committed_checkpoint_is_valid_and_manifest_lists_files(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path, 5)
    assert on_disk.problems(d) == []
    manifest = json.loads((d / on_disk.MANIFEST).read_text())
    assert set(manifest["files"]) == {"__0_0.distcp", ".metadata"}
    assert manifest["step"] == 5 and manifest["world_size"] == 2
    assert not on_disk.tmp_dir(tmp_path, 5).exists()


def test_truncated_shard_is_named(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path, 5)
    with open(d / "__0_0.distcp", "r+b") as fh:
        fh.truncate(100)
    [why] = on_disk.problems(d)
    assert "__0_0.distcp" in why and "truncated" in why


def test_altered_shard_fails_checksum_only_when_checked(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path, 5)
    data = bytearray((d / "__0_0.distcp").read_bytes())
    data[10] ^= 0xFF  # same size, one byte changed
    (d / "__0_0.distcp").write_bytes(bytes(data))
    [why] = on_disk.problems(d)
    assert "__0_0.distcp" in why and "SHA-256" in why
    assert on_disk.problems(d, checksums=False) == []


def test_missing_marker_and_edited_manifest(tmp_path: Path) -> None:
    d = make_checkpoint(tmp_path, 5)
    manifest = json.loads((d / on_disk.MANIFEST).read_text())
    manifest["files"]["__0_0.distcp"]["size"] = 1
    (d / on_disk.MANIFEST).write_text(json.dumps(manifest))
    assert "does not match" in on_disk.problems(d)[0]
    (d / on_disk.COMPLETE).unlink()
    assert "COMPLETE" in on_disk.problems(d)[0]


def test_retention_keeps_last_every_and_newest_valid() -> None:
    steps = [10, 20, 30, 40, 50, 60]
    assert on_disk.retention(steps, keep_last=2, keep_every=0, newest_valid=60) == {10, 20, 30, 40}
    assert on_disk.retention(steps, keep_last=2, keep_every=30, newest_valid=60) == {10, 20, 40}
    # the newest *valid* one survives even when newer (broken) ones fill keep_last
    assert 40 not in on_disk.retention(steps, keep_last=1, keep_every=0, newest_valid=40)


def test_split_merge_roundtrip_keeps_tensors_out_of_json() -> None:
    state = {
        "model": {"w": torch.randn(3), "b": torch.zeros(2)},
        "optim": {
            "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(3)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w", "b"]}],
        },
        "user": {"empty": {}, "counts": {"n": 7, "seen": [1, 2]}},
    }
    tensors, plain = split_state(state)
    text = json.dumps(plain)  # must be plain JSON
    assert "exp_avg" not in text
    back = merge_state(tensors, json.loads(text))
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(back["optim"]["state"]["w"]["exp_avg"], torch.ones(3))
    assert back["user"] == {"empty": {}, "counts": {"n": 7, "seen": [1, 2]}}


def test_unsupported_value_is_an_error_naming_its_path() -> None:
    with pytest.raises(StateError, match=r"user\.fn"):
        split_state({"user": {"fn": object()}})


def test_rng_roundtrip() -> None:
    saved = json.loads(json.dumps(capture_rng()))
    expect = (random.random(), float(np.random.rand()), torch.rand(2))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    restore_rng(saved)
    got = (random.random(), float(np.random.rand()), torch.rand(2))
    assert got[:2] == expect[:2] and torch.equal(got[2], expect[2])
