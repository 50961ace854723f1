"""Checkpoints and pretrained directories that cannot run code or read outside themselves.

Checkpoints are written here by DCP in one process and committed as meshrun commits them; an
attacker's edits are then made the way anyone who can write the files could make them,
re-hashing the manifest and its COMPLETE marker so that every checksum matches:

- a ``.metadata`` pickle whose ``__reduce__`` writes a marker file (plain ``pickle`` runs it:
  DCP's own ``FileSystemReader`` does, shown first) is refused by ``ckpt list``, ``verify``,
  ``inspect``, ``export``, ``checkpoint.init_from`` and the resume choice, and the marker never
  appears; so are a metadata that points DCP at a file outside the directory and one with a
  non-tensor entry (DCP loads those with ``torch.load(weights_only=False)``);
- manifest entries ``../x``, absolute paths and symlinks resolving outside are refused by
  ``list``, ``verify``, ``inspect`` and ``export``, naming the entry and the manifest;
- an HF index naming ``../x`` or a symlinked shard outside is refused by ``load_pretrained``
  (a hub-cache snapshot, whose files are symlinks into its ``blobs/``, still loads);
- dtypes: an int64 tensor into a float parameter is an error naming the key and both dtypes
  (``load_pretrained``, ``init_from``, the resume's key check); a float -> float cast loads
  exactly what the cast gives and is logged.

The full resume path in real processes (a run with ``checkpoint.resume`` on a crafted
checkpoint) is in tests/dist/test_checkpoint_safety.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from meshrun.checkpoint import CheckpointError, on_disk
from meshrun.checkpoint.checks import check_keys, pick
from meshrun.checkpoint.init_from import load_initial_weights
from meshrun.checkpoint.safe_metadata import MetadataError, read_metadata
from meshrun.cli.main import main as cli_main
from meshrun.hf import PretrainedError, load_pretrained

CPU = torch.device("cpu")
EXEC = r"refers to builtins\.exec, which no DCP metadata file holds"


class WritesMarker:
    """What an attacker pickles: unpickling it calls ``exec`` on code that writes a file."""

    def __init__(self, marker: Path) -> None:
        self.code = f"open({str(marker)!r}, 'w').write('ran')"

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (self.code,))


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def commit_checkpoint(root: Path, sd: dict[str, torch.Tensor]) -> Path:
    """A committed checkpoint of ``sd`` under ``model.`` (as meshrun's saves name it)."""
    tmp, final = on_disk.tmp_dir(root, 1), on_disk.step_dir(root, 1)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({f"model.{k}": v for k, v in sd.items()}, checkpoint_id=str(tmp))
    on_disk.commit_dir(tmp, final, on_disk.build_manifest(tmp, step=1, meta={"world_size": 1}))
    assert on_disk.problems(final) == []
    return final


def rehash(d: Path, files: dict[str, Path] | None = None) -> None:
    """Rewrite the manifest and its marker so that every listed file's checksum matches (what
    anyone who can write the directory can do); ``files``: extra entries -> the file hashed."""
    manifest = json.loads((d / on_disk.MANIFEST).read_text())
    for rel in list(manifest["files"]):
        if (d / rel).is_file():
            manifest["files"][rel] = on_disk.hash_files(d, [rel])[rel]
    for rel, real in (files or {}).items():
        manifest["files"][rel] = {"size": real.stat().st_size, "sha256": on_disk.sha256_file(real)}
    blob = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (d / on_disk.MANIFEST).write_bytes(blob)
    (d / on_disk.COMPLETE).write_text(hashlib.sha256(blob).hexdigest())


@pytest.fixture
def crafted(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint whose .metadata runs code when unpickled, manifest re-hashed."""
    d = commit_checkpoint(tmp_path / "ckpt", small_model().state_dict())
    marker = tmp_path / "marker"
    (d / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    rehash(d)
    return d, marker


def test_the_crafted_metadata_runs_code_in_plain_dcp(crafted: tuple[Path, Path]) -> None:
    """The attack is real: DCP's own reader runs it (what meshrun called before)."""
    d, marker = crafted
    with contextlib.suppress(Exception):  # exec returns None: no Metadata, the code has run
        dcp.FileSystemReader(str(d)).read_metadata()
    assert marker.read_text() == "ran"


def test_crafted_metadata_is_refused_by_every_command(
    crafted: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d, marker = crafted
    assert cli_main(["ckpt", "list", str(d.parent)]) == 0
    assert cli_main(["ckpt", "verify", str(d)]) == 1
    assert cli_main(["ckpt", "inspect", str(d)]) == 2
    assert cli_main(["ckpt", "export", str(d), str(tmp_path / "out.safetensors")]) == 1
    assert cli_main(["ckpt", "export", "--hf", str(d), str(tmp_path / "hf")]) == 1
    out = capsys.readouterr().out
    assert out.count("refers to builtins.exec") == 5, out  # list, verify, inspect, 2 exports
    assert "OK (all checksums match)" not in out
    with pytest.raises(CheckpointError, match=EXEC):
        load_initial_weights(d, small_model(), CPU, 0)  # checkpoint.init_from = PATH
    with pytest.raises(CheckpointError, match="holds no valid meshrun checkpoint"):
        load_initial_weights(d.parent, small_model(), CPU, 0)  # init_from = a root: skipped
    with pytest.raises(CheckpointError, match=EXEC):
        pick(d.parent, str(d))  # checkpoint.resume = PATH
    assert pick(d.parent, "auto") is None  # resume=auto skips it (with a warning)
    with pytest.raises(MetadataError, match=EXEC):
        read_metadata(d)
    assert not marker.exists()
    assert not (tmp_path / "out.safetensors").exists()


def _edit_metadata(d: Path, edit: Any) -> None:
    meta = read_metadata(d)
    edit(meta)
    (d / ".metadata").write_bytes(pickle.dumps(meta))
    rehash(d)


def test_metadata_pointing_outside_or_at_pickled_bytes_is_refused(tmp_path: Path) -> None:
    d = commit_checkpoint(tmp_path / "a", small_model().state_dict())

    def outside(meta: Any) -> None:
        for k, info in meta.storage_data.items():
            meta.storage_data[k] = _StorageInfo("../../secret", info.offset, info.length)

    _edit_metadata(d, outside)
    [why] = on_disk.problems(d)
    assert "'../../secret'" in why and "not a file name of the checkpoint" in why
    e = commit_checkpoint(tmp_path / "b", small_model().state_dict())
    _edit_metadata(e, lambda meta: meta.state_dict_metadata.update(x=BytesStorageMetadata()))
    [why] = on_disk.problems(e)
    assert "entry 'x' is a BytesStorageMetadata" in why


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_manifest_entries_outside_the_directory_are_refused(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = commit_checkpoint(tmp_path / "ckpt", small_model().state_dict())
    secret = tmp_path / "secret.txt"  # stands for a system file outside the checkpoint
    secret.write_text("root:x:0:0\n")
    entry = {"dotdot": "../../secret.txt", "absolute": str(secret), "symlink": "link"}[kind]
    if kind == "symlink":
        os.symlink(secret, d / "link")
    rehash(d, {entry: secret})
    assert cli_main(["ckpt", "list", str(d.parent)]) == 0
    assert cli_main(["ckpt", "verify", str(d)]) == 1
    assert cli_main(["ckpt", "inspect", str(d)]) == 2
    assert cli_main(["ckpt", "export", str(d), str(tmp_path / "out.safetensors")]) == 1
    out = capsys.readouterr().out
    assert out.count(f"step_00000001/manifest.json: entry {entry!r}") == 4, out
    assert "OK (all checksums match)" not in out and "root:x" not in out


def test_symlink_inside_the_directory_is_fine(tmp_path: Path) -> None:
    d = commit_checkpoint(tmp_path / "ckpt", small_model().state_dict())
    (d / "notes").mkdir()
    (d / "notes" / "a.txt").write_text("x")
    os.symlink("notes/a.txt", d / "alias.txt")
    rehash(d, {"alias.txt": d / "notes" / "a.txt"})
    assert on_disk.problems(d) == []


# --- Hugging Face directories --------------------------------------------------------------


def save_hf(d: Path, sd: dict[str, torch.Tensor], shards: int = 2) -> None:
    """``sd`` as an index and ``shards`` safetensors files (a save_pretrained layout)."""
    d.mkdir(parents=True, exist_ok=True)
    names = sorted(sd)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: sd[n].contiguous() for n in names[i::shards]}
        save_file(part, str(d / file))
        weight_map |= {n: file for n in part}
    index = {"metadata": {}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def test_hf_index_entries_outside_the_directory_are_refused(tmp_path: Path) -> None:
    sd = small_model().state_dict()
    d = tmp_path / "hf"
    save_hf(d, sd)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = next(iter(index["weight_map"]))
    shard = index["weight_map"][victim]
    (tmp_path / "outside.safetensors").write_bytes((d / shard).read_bytes())
    for entry in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        index["weight_map"][victim] = entry
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(
            PretrainedError, match=r"model\.safetensors\.index\.json: names the file"
        ):
            load_pretrained(small_model(), d, device=CPU)
    index["weight_map"][victim] = "link.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    os.symlink(tmp_path / "outside.safetensors", d / "link.safetensors")
    with pytest.raises(
        PretrainedError, match=r"'link\.safetensors' is a symlink resolving outside"
    ):
        load_pretrained(small_model(), d, device=CPU)


def test_hub_cache_snapshot_symlinks_into_blobs_load(tmp_path: Path) -> None:
    sd = small_model().state_dict()
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    save_hf(snap, sd, shards=1)
    file = snap / "model-00001-of-00001.safetensors"
    file.rename(repo / "blobs" / "f00d")
    os.symlink("../../blobs/f00d", file)  # as huggingface_hub lays a snapshot out
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    load_pretrained(model, snap, device=CPU)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())


def test_integer_tensor_into_a_float_parameter_is_an_error(tmp_path: Path) -> None:
    sd = dict(small_model().state_dict())
    sd["0.weight"] = torch.zeros(3, 4, dtype=torch.int64)
    save_hf(tmp_path / "hf", sd)
    with pytest.raises(
        PretrainedError, match=r"0\.weight: I64 in the checkpoint, F32 in the model"
    ):
        load_pretrained(small_model(), tmp_path / "hf", device=CPU)
    ckpt = commit_checkpoint(tmp_path / "ckpt", sd)
    with pytest.raises(CheckpointError, match=r"model\.0\.weight: saved as torch\.int64, this"):
        load_initial_weights(ckpt, small_model(), CPU, 0)
    model = small_model()
    with pytest.raises(CheckpointError, match=r"model\.0\.weight: saved as torch\.int64"):
        check_keys(ckpt, {"model": dict(model.state_dict())})  # what resume checks first


def test_float_to_float_cast_loads_and_is_printed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sd = {k: v.to(torch.bfloat16) for k, v in small_model().state_dict().items()}
    save_hf(tmp_path / "hf", sd)
    ckpt = commit_checkpoint(tmp_path / "ckpt", sd)
    caplog.set_level(logging.INFO, logger="meshrun")
    for load in (
        lambda m: load_pretrained(m, tmp_path / "hf", device=CPU),
        lambda m: load_initial_weights(ckpt, m, CPU, 0),
    ):
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        load(model)
        assert all(torch.equal(model.state_dict()[k], v.float()) for k, v in sd.items())
    text = caplog.text
    assert "4 tensor(s) cast BF16 -> F32" in text, text
    assert "4 tensor(s) bfloat16 -> float32" in text, text


def test_a_table_that_disagrees_with_its_data_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Re-hashed edits of the storage table: a float32 tensor declared int64 (DCP would cast
    its bytes' values into int64 zeros on export) and a chunk said to lie past its file's end
    (EOFError inside DCP) are refused by name, before DCP reads a byte."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    big = {"w": torch.randn(64, 64)}  # 16 KiB of float32: well above torch.save's framing
    d = commit_checkpoint(tmp_path / "a", big)

    def as_int64(meta: Any) -> None:
        entry = meta.state_dict_metadata["model.w"]
        entry.properties = TensorProperties(dtype=torch.int64)

    _edit_metadata(d, as_int64)
    [why] = on_disk.problems(d)
    assert "'model.w' is declared torch.int64 of [64, 64] (32768 bytes)" in why, why
    assert cli_main(["ckpt", "export", str(d), str(tmp_path / "out.safetensors")]) == 1
    assert not (tmp_path / "out.safetensors").exists()
    e = commit_checkpoint(tmp_path / "b", big)

    def past_the_end(meta: Any) -> None:
        for k, info in meta.storage_data.items():
            meta.storage_data[k] = _StorageInfo(
                info.relative_path, info.offset + 10**6, info.length
            )

    _edit_metadata(e, past_the_end)
    [why] = on_disk.problems(e)
    assert "is said to lie at bytes" in why and "refused" in why, why
    assert cli_main(["ckpt", "inspect", str(e)]) == 2
    assert "Traceback" not in capsys.readouterr().out


def test_inspect_names_a_flipped_bit_that_was_not_rehashed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = commit_checkpoint(tmp_path / "ckpt", small_model().state_dict())
    data = next(p for p in d.iterdir() if p.suffix == ".distcp")
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x01  # one bit, the size unchanged: only a checksum sees it
    data.write_bytes(bytes(blob))
    assert cli_main(["ckpt", "inspect", str(d)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("meshrun ckpt inspect: error:") and data.name in out, out
    assert cli_main(["ckpt", "inspect", "--no-checksums", str(d)]) == 0  # asked not to look
