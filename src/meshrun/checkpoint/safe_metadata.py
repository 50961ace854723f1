"""DCP's ``.metadata`` read without running code, and handed to DCP already read.

``torch.distributed.checkpoint`` writes its metadata (tensor names, dtypes, shapes, which bytes
of which file hold each chunk) with :mod:`pickle`, and its ``FileSystemReader`` reads it back
with a plain ``pickle.load``: a checkpoint whose ``.metadata`` was replaced (and its manifest
re-hashed, which anyone who can write the files can do) runs its author's code in every
command and job that opens it. So meshrun reads it here, through an unpickler whose
``find_class`` resolves only the classes a DCP metadata file holds (the set found by pickling
the metadata of checkpoints saved under DDP, ZeRO-1, ZeRO-3 (FSDP2, DTensor), tensor parallel
(DTensor) and pipeline parallel: DCP's metadata dataclasses, ``_StorageInfo``, ``torch.Size``,
torch dtypes, the layout lookup, ``pathlib`` paths), then checks what it read:

- every entry is a tensor: DCP loads a non-tensor entry with ``torch.load(weights_only=False)``
  (code again), and meshrun never writes one (its plain state is JSON);
- every data file the metadata points at is a plain file name of the checkpoint directory
  (no ``..``, no ``/``), and, when the caller gives the manifest's files, one of them.

:class:`SafeReader` is the ``FileSystemReader`` every meshrun load hands to DCP: its
``read_metadata`` returns the metadata read here, so nothing is unpickled by DCP itself.
The tensors are then read by DCP with ``torch.load(weights_only=True)``.

``on_disk.problems`` (``meshrun ckpt list``) imports this module (and torch) only when a
checkpoint's manifest lists a ``.metadata``.
"""

from __future__ import annotations

import importlib
import io
import math
import pickle
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

__all__ = [
    "METADATA",
    "MetadataError",
    "SafeReader",
    "cast_text",
    "dtype_casts",
    "load",
    "metadata_problems",
    "read_metadata",
]

METADATA = ".metadata"  # on_disk.DCP_METADATA
_DCP_META = "torch.distributed.checkpoint.metadata"
# (module, name) a DCP metadata file refers to; dtypes are added from torch itself.
_ALLOWED = {
    *(
        (_DCP_META, n)
        for n in (
            "Metadata",
            "MetadataIndex",
            "ChunkStorageMetadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",  # read so that the refusal can name the entry
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # "torch.strided" -> torch.strided (a lookup)
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class MetadataError(ValueError):
    """A ``.metadata`` meshrun refuses to load; the message names the file and why."""


def _dtype_names() -> set[tuple[str, str]]:
    return {("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: Path) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where
        self.allowed = _ALLOWED | _dtype_names()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise MetadataError(
                f"{self.where}: refers to {module}.{name}, which no DCP metadata file holds: "
                "refused without loading it (a crafted or foreign file; meshrun reads only "
                "DCP's metadata classes, torch dtypes and sizes)"
            )
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid: Any) -> Any:
        raise MetadataError(f"{self.where}: holds a persistent reference, which DCP never writes")


def read_metadata(directory: Path, files: Collection[str] | None = None) -> Metadata:
    """The checkpoint's DCP metadata, read through the restricted unpickler and checked;
    ``files``: the manifest's files (each data file named must be one). Raises
    :class:`MetadataError` naming the file and the reason."""
    where = Path(directory) / METADATA
    try:
        data = where.read_bytes()
    except OSError as e:
        raise MetadataError(f"{where}: unreadable ({e.strerror})") from None
    try:
        meta = _Unpickler(data, where).load()
    except MetadataError:
        raise
    except Exception as e:  # a truncated or garbled pickle: its error, named
        raise MetadataError(f"{where}: not a DCP metadata file ({type(e).__name__}: {e})") from None
    _check(meta, where, files)
    return meta


def metadata_problems(directory: Path, files: Collection[str]) -> list[str]:
    """Why the ``.metadata`` of ``directory`` must not be loaded (empty: it may); for
    ``on_disk.problems``, which every command and resume runs before DCP opens a checkpoint."""
    if METADATA not in files:
        return []  # not a DCP checkpoint's manifest: nothing meshrun would unpickle
    try:
        read_metadata(directory, files)
    except MetadataError as e:
        return [str(e)]
    return []


def _check(meta: Any, where: Path, files: Collection[str] | None) -> None:
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise MetadataError(f"{where}: holds a {type(meta).__name__}, not DCP's Metadata")
    for key, entry in meta.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise MetadataError(
                f"{where}: entry {key!r} is a {type(entry).__name__}, not a tensor; DCP loads "
                "such entries with torch.load(weights_only=False) (code), and meshrun never "
                "writes them (its non-tensor state is JSON): refused"
            )
    storage = meta.storage_data if isinstance(meta.storage_data, dict) else None
    if storage is None:
        raise MetadataError(f"{where}: no storage table (which file holds which tensor)")
    for info in storage.values():
        name = info.relative_path if isinstance(info, _StorageInfo) else None
        if not isinstance(name, str) or not _plain_name(name):
            raise MetadataError(
                f"{where}: a tensor's data is said to be in {name!r}, not a file name of the "
                "checkpoint directory (no '/', no '..'): refused"
            )
        if files is not None and name not in files:
            raise MetadataError(
                f"{where}: a tensor's data is said to be in {name!r}, which the manifest does "
                "not list: refused"
            )
    _check_extents(meta, where)


def _check_extents(meta: Metadata, where: Path) -> None:
    """Each chunk's bytes lie inside its file and hold at least its elements at the declared
    dtype: a table claiming int64 over float32 bytes would otherwise load as zeros (DCP casts
    what torch.load returns into the declared dtype), and one past a file's end as EOFError."""
    sizes: dict[str, int] = {}
    for index, info in meta.storage_data.items():
        entry = meta.state_dict_metadata.get(str(getattr(index, "fqn", "")))
        if not isinstance(entry, TensorStorageMetadata):
            raise MetadataError(f"{where}: the storage table names {index!r}, no tensor of it")
        path = where.parent / info.relative_path
        if info.relative_path not in sizes:
            sizes[info.relative_path] = path.stat().st_size if path.is_file() else -1
        end = sizes[info.relative_path]
        if end >= 0 and (info.offset < 0 or info.length < 0 or info.offset + info.length > end):
            raise MetadataError(
                f"{where}: {index.fqn!r} is said to lie at bytes {info.offset}..."
                f"{info.offset + info.length} of {info.relative_path}, which has {end}: refused"
            )
        chunk = next(
            (c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset or ())), None
        )
        if chunk is None:
            continue  # a chunk index DCP did not write: DCP's own planner refuses it
        needed = math.prod(chunk.sizes) * entry.properties.dtype.itemsize
        if info.length < needed:
            raise MetadataError(
                f"{where}: {index.fqn!r} is declared {entry.properties.dtype} of "
                f"{list(chunk.sizes)} ({needed} bytes) but its data has {info.length} bytes: "
                "the table and the data disagree (a tampered or mixed-up checkpoint): refused"
            )


def _plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader of one checkpoint whose metadata comes from :func:`read_metadata`."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.directory = Path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: meshrun never writes them
            raise MetadataError(f"{self.directory}: per-rank DCP metadata is not read")
        meta = read_metadata(self.directory)
        if meta.storage_meta is None:  # as FileSystemReader.read_metadata does
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


def load(state: dict[str, Any], path: Path) -> None:
    """``dcp.load`` of ``state`` from the checkpoint ``path``, its metadata read safely."""
    dcp.load(state, storage_reader=SafeReader(Path(path)))


def dtype_casts(
    meta: Metadata, flat: dict[str, Any]
) -> tuple[list[str], list[tuple[str, torch.dtype, torch.dtype]]]:
    """``(errors, casts)`` of loading ``meta``'s tensors into ``flat`` (flattened state).

    DCP copies each saved tensor into the one given (``copy_``), which converts any dtype
    silently: an int64 tensor into a float parameter loads its integers as floats. The rule
    (docs/checkpoint.md): the same dtype loads; a floating-point tensor into another
    floating-point dtype is a cast the caller prints; anything else (an integer or bool on
    either side) is an error naming the key and both dtypes."""
    errors, casts = [], []
    for key, value in flat.items():
        entry = meta.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata) or not isinstance(value, torch.Tensor):
            continue
        saved, target = entry.properties.dtype, value.dtype
        if saved == target:
            continue
        if saved.is_floating_point and target.is_floating_point:
            casts.append((key, saved, target))
        else:
            errors.append(f"{key}: saved as {saved}, this run's tensor is {target}")
    return errors, casts


def cast_text(casts: list[tuple[str, torch.dtype, torch.dtype]]) -> str:
    """One line for the floating-point casts of a load, grouped by (saved, target) dtype."""
    groups: dict[tuple[str, str], list[str]] = {}
    for key, saved, target in casts:
        groups.setdefault((str(saved), str(target)), []).append(key)
    return "; ".join(
        f"{len(keys)} tensor(s) {a.removeprefix('torch.')} -> {b.removeprefix('torch.')} "
        f"(e.g. {keys[0]})"
        for (a, b), keys in sorted(groups.items())
    )
