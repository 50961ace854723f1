"""The node-local snapshots are the user's alone and verified: their directory private (0700,
this user's, nobody else may write in it: refused otherwise, naming it), their files 0600, and
every file carrying a SHA-256 that a restore checks (refused otherwise, with a message). Plain
files and directories here; the removal at the end of a run and a refused restore in a real
run are tests/dist/test_local_tier_private_run.py."""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from meshrun.checkpoint.checks import CheckpointError
from meshrun.checkpoint.local.files import decode, encode, private_dir, write_atomically
from meshrun.checkpoint.local.tier import _node_dir, default_local_dir

OTHER_UID = 65534  # nobody


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_new_directory_is_created_private_and_files_0600(tmp_path: Path) -> None:
    old = os.umask(0)  # the most open umask: the modes must not depend on it
    try:
        node = tmp_path / "local" / "node0"
        private_dir(node, "checkpoint.local_dir")
        write_atomically(node / "w00002-ab" / "step_000000002" / "rank_00000.pt", b"x")
    finally:
        os.umask(old)
    assert _mode(node) == 0o700
    assert _mode(node / "w00002-ab") == 0o700
    assert _mode(node / "w00002-ab" / "step_000000002" / "rank_00000.pt") == 0o600


def test_an_own_open_directory_is_made_private(tmp_path: Path) -> None:
    node = tmp_path / "node0"
    node.mkdir(mode=0o755)
    node.chmod(0o755)
    private_dir(node, "checkpoint.local_dir")
    assert _mode(node) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_refused_naming_it(tmp_path: Path) -> None:
    node = tmp_path / "node0"
    node.mkdir(mode=0o700)
    os.chown(node, OTHER_UID, -1)
    with pytest.raises(CheckpointError, match=f"checkpoint.local_dir {node} is owned by uid "):
        private_dir(node, "checkpoint.local_dir")


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o722])
def test_a_directory_others_may_write_in_is_refused(tmp_path: Path, mode: int) -> None:
    node = tmp_path / "node0"
    node.mkdir()
    node.chmod(mode)
    with pytest.raises(CheckpointError, match=f"{node} can be written by other users"):
        private_dir(node, "checkpoint.local_dir")


def test_a_symbolic_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "node0").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="is not a directory"):
        private_dir(tmp_path / "node0", "checkpoint.local_dir")


def test_the_default_directory_is_private_per_user_and_run(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    node = _node_dir("", 0, root)
    try:
        assert node == default_local_dir(root)
        assert node.parent.name == f"meshrun-{os.getuid()}"
        assert _mode(node) == 0o700 and _mode(node.parent) == 0o700
    finally:
        shutil.rmtree(node, ignore_errors=True)


def _shard(path: Path) -> dict[str, torch.Tensor]:
    tensors = {"model": {"w": torch.arange(64, dtype=torch.float32)}, "b": torch.ones(3)}
    write_atomically(path, encode(tensors, {"step": 4}))
    return tensors


def test_a_snapshot_round_trips_with_its_checksum(tmp_path: Path) -> None:
    tensors = _shard(tmp_path / "s.pt")
    got, meta = decode(tmp_path / "s.pt")
    assert meta == {"step": 4} and torch.equal(got["model"]["w"], tensors["model"]["w"])


def test_a_changed_tensor_byte_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.pt"
    _shard(path)
    with zipfile.ZipFile(path) as z:  # torch.save's zip: find the stored bytes of tensor "w"
        at = next(i for i in z.infolist() if i.file_size == 64 * 4).header_offset
    raw = bytearray(path.read_bytes())
    # its local header: 30 bytes, then the name and the (alignment) extra field, then the data
    offset = at + 30 + int.from_bytes(raw[at + 26 : at + 28], "little")
    offset += int.from_bytes(raw[at + 28 : at + 30], "little")
    raw[offset + 5] ^= 0x40  # one bit of one float, as a bad DIMM or disk would
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        decode(path)


def test_a_snapshot_without_a_checksum_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.pt"
    torch.save({"tensors": {"w": torch.ones(2)}, "meta": '{"step": 4}'}, path)  # no "sha256"
    with pytest.raises(CheckpointError, match="no checksum"):
        decode(path)
