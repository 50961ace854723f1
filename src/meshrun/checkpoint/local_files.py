"""The node-local tier's files: one ``torch.save`` file per rank and step holding that rank's
tensors (a nested dict of plain tensors) and its JSON state, read back with
``torch.load(weights_only=True)``, so loading never unpickles anything but tensors, dicts and
strings. Written to a temporary name and renamed: a crash mid-write leaves the temporary file
(ignored, removed later), never a torn shard under the final name.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from meshrun.checkpoint.local_plan import Held, parse_history, parse_shard, parse_step
from meshrun.parallel.kinds import is_dtensor

__all__ = ["decode", "encode", "remove_steps", "scan", "to_local", "write_atomically"]


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` under ``path``, all or nothing: temporary file, fsync, rename, fsync of the
    directory (on local NVMe the rename is then durable too; on /dev/shm the syncs are free)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # unique per writer
    with open(tmp, "wb") as fh:
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
    buf = io.BytesIO()
    torch.save({"tensors": tensors, "meta": json.dumps(meta)}, buf)
    return buf.getvalue()


def decode(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, meta)`` of one shard file (tensors on the CPU). Memory-mapped: the tensors
    are read from the page cache or RAM disk once, when copied into the model's own."""
    blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return blob["tensors"], json.loads(blob["meta"])
