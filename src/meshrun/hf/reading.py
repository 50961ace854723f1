"""A Hugging Face directory's tensors, read with the ``safetensors`` library, slice by slice.

The index (names, shapes, dtypes, files) comes from the files' headers alone, so names and
shapes are checked before any weight is read. Every file an index names must lie inside the
directory (no absolute path, no ``..``, no symlink resolving outside it; the hub cache's
snapshot -> blob symlinks excepted): an index is data from whoever wrote the directory. Each region is then read by its own
``safe_open`` -> ``get_slice(name)[region]`` -> ``copy_`` -> close: ``safe_open`` maps the
whole file, and every page a read touches stays resident (and counts in the process's RSS)
until the file is closed. Measured here on a 256 MB file: reading half of each of its four
tensors through one open handle left 131 MB of file pages resident; one open per tensor left
none after each copy. So at most one region's pages are mapped at any time.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from meshrun.hf.names import PretrainedError

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "TensorInfo",
    "copy_region",
    "is_hf_directory",
    "read_index",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
Region = tuple[slice, ...]


@dataclass(frozen=True)
class TensorInfo:
    """Where one checkpoint tensor lives and what it is (from the file's header)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, ...

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _ITEM_BYTES.get(self.dtype, 4)


_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2}
_ITEM_BYTES |= {"I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def is_hf_directory(path: Path) -> bool:
    """Whether ``path`` holds a Hugging Face safetensors checkpoint (one file or an index)."""
    return (path / INDEX_FILE).is_file() or (path / SINGLE_FILE).is_file()


def _files(directory: Path) -> list[Path]:
    """The safetensors files of ``directory``: the index's, or the one ``model.safetensors``."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise PretrainedError(f"{index}: no 'weight_map' (name -> file): not an HF index")
        files = sorted({_inside(directory, f, index) for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise PretrainedError(
                f"{index} names {len(absent)} file(s) that are not there: {absent[:3]}; copy "
                "the whole directory"
            )
        return files
    if (directory / SINGLE_FILE).is_file():
        return [_inside(directory, SINGLE_FILE, directory / SINGLE_FILE)]
    if not directory.is_dir():
        raise PretrainedError(f"load_pretrained: {directory} is not a directory")
    found = sorted(p.name for p in directory.iterdir())[:8]
    hint = (
        "; meshrun reads safetensors only (it never unpickles): save it again with "
        "save_pretrained(..., safe_serialization=True)"
        if any(n.endswith((".bin", ".pt", ".pth")) for n in found)
        else ""
    )
    raise PretrainedError(
        f"load_pretrained: {directory} has neither {INDEX_FILE} nor {SINGLE_FILE} (it holds "
        f"{found or 'nothing'}); give a directory written by save_pretrained{hint}"
    )


def _inside(directory: Path, name: object, source: Path) -> Path:
    """``directory / name``, refused (naming the entry and ``source``, the file that named it)
    unless it stays inside ``directory``: no absolute path, no ``..``, no symlink resolving
    outside. One exception, the Hugging Face hub cache: a snapshot directory
    (``models--org--name/snapshots/<revision>/``) holds symlinks into its repository's
    ``blobs/`` folder, and those are accepted."""
    text = str(name)
    parts = re.split(r"[/\\]", text)
    if not isinstance(name, str) or not text or Path(text).is_absolute() or ".." in parts:
        raise PretrainedError(
            f"{source}: names the file {name!r}, which is not a path inside {directory}: "
            "refused (an index names the shard files beside it)"
        )
    root = directory.resolve()
    target = (root / text).resolve()
    if target.is_relative_to(root) or _hub_blob(root, target):
        return directory / text
    raise PretrainedError(
        f"{source}: {text!r} is a symlink resolving outside {directory}, to {target}: refused "
        "(copy the files into the directory)"
    )


def _hub_blob(root: Path, target: Path) -> bool:
    """Whether ``target`` is a blob of the hub-cache repository whose snapshot ``root`` is."""
    if root.parent.name != "snapshots":
        return False
    return target.is_relative_to(root.parent.parent / "blobs")


def read_index(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of the directory by name, from the headers (no weight is read)."""
    out: dict[str, TensorInfo] = {}
    for file in _files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                names = f.keys()  # a safe_open handle is not iterable
                for name in names:
                    piece = f.get_slice(name)
                    out[name] = TensorInfo(file, tuple(piece.get_shape()), piece.get_dtype())
        except (SafetensorError, OSError) as e:  # the library's message names no file
            raise PretrainedError(
                f"{file}: not a readable safetensors file ({e}); re-download or re-export it"
            ) from None
    return out


def copy_region(info: TensorInfo, name: str, region: Region | None, into: torch.Tensor) -> int:
    """Read ``region`` of tensor ``name`` (None: all of it) into ``into``; the bytes read."""
    try:
        return _copy_region(info, name, region, into)
    except (SafetensorError, OSError) as e:  # the library's message names no file
        raise PretrainedError(
            f"{info.file}: tensor {name!r} cannot be read ({e}); the file is damaged or was "
            "changed after its header was read: re-download or re-export it"
        ) from None


def _copy_region(info: TensorInfo, name: str, region: Region | None, into: torch.Tensor) -> int:
    with safe_open(str(info.file), framework="pt") as f:
        if not info.shape:  # a 0-dim tensor cannot be sliced
            value = f.get_tensor(name)
        else:
            piece = f.get_slice(name)
            value = piece[region] if region else piece[:]
        if tuple(value.shape) != tuple(into.shape):  # a region computed wrongly is a bug here
            raise PretrainedError(
                f"{name}: read {list(value.shape)} for a local tensor of {list(into.shape)}"
            )
        with torch.no_grad():
            into.copy_(value)
        read = value.numel() * value.element_size()
        del value  # its pages are unmapped when the file closes and nothing points there
    return read
