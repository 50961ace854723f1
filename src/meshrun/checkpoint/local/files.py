"""The node-local tier's files: one ``torch.save`` file per rank and step holding that rank's
tensors (a nested dict of plain tensors), its JSON state and their SHA-256, read back with
``torch.load(weights_only=True)``, so loading never unpickles anything but tensors, dicts and
strings, and refused unless the checksum matches. Written (mode 0600) to a temporary name and
renamed: a crash mid-write leaves the temporary file (ignored, removed later), never a torn
shard under the final name. The directories are private to the user (0700, checked).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from meshrun.checkpoint.checks import CheckpointError
from meshrun.checkpoint.local.rules import Held, parse_history, parse_shard, parse_step
from meshrun.parallel.kinds import is_dtensor

__all__ = [
    "decode",
    "encode",
    "make_dirs",
    "private_dir",
    "remove_steps",
    "scan",
    "to_local",
    "write_atomically",
]

PRIVATE = 0o700  # the snapshots hold the model, optimizer and RNG state: the user's alone
_FILE_MODE = 0o600


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` under ``path``, all or nothing: temporary file, fsync, rename, fsync of the
    directory (on local NVMe the rename is then durable too; on /dev/shm the syncs are free)."""
    make_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # unique per writer
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    with open(os.open(tmp, flags, _FILE_MODE), "wb") as fh:
        os.fchmod(fh.fileno(), _FILE_MODE)  # a leftover temporary file keeps its old mode
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scan(node_dir: Path) -> list[Held]:
    """Every finished shard file under one node's directory."""
    found: list[Held] = []
    if not node_dir.is_dir():
        return found
    for hist in node_dir.iterdir():
        if parse_history(hist.name) is None or not hist.is_dir():
            continue
        for sdir in hist.iterdir():
            step = parse_step(sdir.name)
            if step is None or not sdir.is_dir():
                continue
            for f in sdir.iterdir():
                shard = parse_shard(f.name)
                if shard is not None:
                    found.append(Held(hist.name, step, shard))
    return found


def remove_steps(history_dir: Path, steps: set[int]) -> None:
    for step_dir in list(history_dir.iterdir()) if history_dir.is_dir() else []:
        if parse_step(step_dir.name) in steps:
            shutil.rmtree(step_dir, ignore_errors=True)


def to_local(tree: Any) -> Any:
    """The same nested dict with every DTensor replaced by this rank's local shard, on the CPU,
    and every view copied out (``torch.save`` writes a view's whole storage otherwise)."""
    if isinstance(tree, dict):
        return {k: to_local(v) for k, v in tree.items()}
    t = tree.to_local() if is_dtensor(tree) else tree
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu")
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole and t.is_contiguous() else t.clone()


def encode(tensors: dict[str, Any], meta: dict[str, Any]) -> bytes:
    text = json.dumps(meta)
    buf = io.BytesIO()
    torch.save({"tensors": tensors, "meta": text, "sha256": _digest(tensors, text)}, buf)
    return buf.getvalue()


def decode(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, meta)`` of one shard file (tensors on the CPU), its checksum verified.
    Memory-mapped: the tensors are read from the page cache or RAM disk when hashed and when
    copied into the model's own."""
    blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    saved = blob.get("sha256") if isinstance(blob, dict) else None
    if not isinstance(saved, str):
        raise CheckpointError(
            f"{path}: no checksum (not a node-local snapshot of this meshrun version); "
            "refused: delete it, the shared checkpoint is restored instead"
        )
    if _digest(blob["tensors"], blob["meta"]) != saved:
        raise CheckpointError(
            f"{path}: checksum mismatch (the file changed after it was written: a bad disk or "
            "memory, or someone else's write); refused, the shared checkpoint is restored instead"
        )
    return blob["tensors"], json.loads(blob["meta"])


def _digest(tensors: dict[str, Any], meta: str) -> str:
    """SHA-256 of the JSON state and of every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(meta.encode())
    for name, t in _leaves(tensors, ""):
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _leaves(tree: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from _leaves(tree[key], f"{prefix}/{key}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree
    else:
        raise CheckpointError(f"node-local snapshot: {prefix} is a {type(tree).__name__}")


def make_dirs(path: Path) -> None:
    """``path`` and its missing parents, each created 0700 (``Path.mkdir`` gives the parents
    the umask's mode)."""
    if path.is_dir():
        return
    make_dirs(path.parent)
    with contextlib.suppress(FileExistsError):  # another rank of this node was first
        path.mkdir(mode=PRIVATE)


def private_dir(path: Path, what: str) -> None:
    """``path`` as a directory only this user can enter: created 0700 (with its parents), or,
    if it exists, refused unless it is a real directory of this user that nobody else may
    write in (then made 0700). ``what`` names its source in the error."""
    make_dirs(path)
    st = os.lstat(path)
    fix = (
        "remove it (as its owner), or set --checkpoint.local_dir=DIR to a directory of your "
        "own (a new one is created with mode 0700)"
    )
    if not stat.S_ISDIR(st.st_mode):  # lstat: a symbolic link is not one
        raise CheckpointError(f"{what} {path} is not a directory (a symbolic link?): {fix}")
    if st.st_uid != os.getuid():
        raise CheckpointError(
            f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}): "
            f"its owner could read or replace the snapshots; {fix}"
        )
    if st.st_mode & 0o022:
        raise CheckpointError(
            f"{what} {path} can be written by other users (mode {st.st_mode & 0o777:o}): they "
            f"could replace the snapshots; {fix}, or chmod 700 it"
        )
    if st.st_mode & 0o777 != PRIVATE:
        os.chmod(path, PRIVATE)  # only this user's: others may not list or read the snapshots
