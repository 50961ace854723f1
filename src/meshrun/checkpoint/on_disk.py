"""A checkpoint on disk (the pure part): directory naming, the manifest, validation, retention.

No process group here: a checkpoint directory is judged from its ``manifest.json`` (files,
sizes, SHA-256), its ``COMPLETE`` marker (the manifest's own SHA-256) and the files on disk.
Every file a manifest names must lie inside the checkpoint directory (a relative path without
``..``, and no symlink resolving outside it), and DCP's pickled ``.metadata`` is read only
through the restricted unpickler of ``safe_metadata.py``: a checkpoint that fails either is
invalid, so no command and no resume loads it. One checkpoint on disk::

    <root>/step_00000120/            renamed into place only after COMPLETE was written
        .metadata  __0_0.distcp ...  torch.distributed.checkpoint (tensors only)
        state.json                   counters, sampler, schedulers, non-tensor optimizer state
        rank_00000.json ...          per-rank RNG states
        manifest.json  COMPLETE
    <root>/step_00000130.tmp/        a save in progress (or killed): never resumed
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "COMPLETE",
    "DCP_METADATA",
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointInfo",
    "build_manifest",
    "commit_dir",
    "escape_error",
    "fsync_dir",
    "hash_files",
    "list_checkpoints",
    "parse_step",
    "problems",
    "resume_path_error",
    "retention",
    "sha256_file",
    "step_dir",
    "tmp_dir",
    "write_file_durably",
]

MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
DCP_METADATA = ".metadata"  # DCP's pickled index of the tensors (read by safe_metadata.py)
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d{8,})$")
_CHUNK = 8 << 20


def step_dir(root: Path, step: int) -> Path:
    """Final directory of the checkpoint of ``step`` (zero-padded: names sort by step)."""
    return Path(root) / f"step_{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    """Where a save of ``step`` is written before it is committed."""
    return Path(root) / f"step_{step:08d}.tmp"


def parse_step(name: str) -> int | None:
    """The step of a committed checkpoint directory name, None for anything else."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """fsync a directory so that a rename or a new file in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def hash_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "sha256"}}`` for the given files of ``directory``."""
    out = {}
    for name in names:
        p = directory / name
        out[name] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    return out


def build_manifest(
    directory: Path,
    *,
    step: int,
    meta: dict[str, Any],
    known: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Manifest of every file in ``directory`` (sizes and SHA-256) plus ``meta`` (world size,
    layout, config digest, ...). Files in ``known`` (hashed by the ranks that wrote them) are
    not read again; an entry whose size no longer matches is an error. The manifest and the
    marker themselves are not listed."""
    known = known or {}
    files = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if not p.is_file() or rel in (MANIFEST, COMPLETE):
            continue
        if rel in known and known[rel]["size"] != p.stat().st_size:
            raise ValueError(f"{p}: size changed after it was hashed")
        files[rel] = known.get(rel) or hash_files(directory, [rel])[rel]
    return {"format": FORMAT_VERSION, "step": step, **meta, "files": files}


def commit_dir(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest and the COMPLETE marker (the manifest's hash), then rename ``tmp`` to
    ``final``; fsync at each point where order matters. A crash at any point leaves either
    the ``.tmp`` directory (ignored) or a complete checkpoint."""
    blob = json.dumps(manifest, indent=1, sort_keys=True).encode()
    write_file_durably(tmp / MANIFEST, blob)
    write_file_durably(tmp / COMPLETE, hashlib.sha256(blob).hexdigest().encode())
    fsync_dir(tmp)
    tmp.rename(final)
    fsync_dir(final.parent)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a checkpoint (plain JSON); raises ValueError naming what is wrong."""
    path = Path(directory) / MANIFEST
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise ValueError(f"{path}: not a meshrun manifest")
    return data


def problems(directory: Path, *, checksums: bool = True) -> list[str]:
    """Why ``directory`` is not a valid checkpoint; empty when it is. With ``checksums``
    every file's SHA-256 is recomputed (reads the whole checkpoint)."""
    d = Path(directory)
    if not d.is_dir():
        return [f"{d}: {'not a directory' if d.exists() else 'does not exist'}"]
    marker, manifest_path = d / COMPLETE, d / MANIFEST
    if not marker.is_file():
        return [f"{d.name}: no {COMPLETE} marker (the save did not finish)"]
    try:
        blob = manifest_path.read_bytes()
    except OSError as e:
        return [f"{d.name}: no readable {MANIFEST} ({e.strerror})"]
    if marker.read_text().strip() != hashlib.sha256(blob).hexdigest():
        return [f"{d.name}: {MANIFEST} does not match its {COMPLETE} marker (altered)"]
    try:
        manifest = read_manifest(d)
    except ValueError as e:
        return [str(e)]
    if manifest.get("format") != FORMAT_VERSION:
        return [f"{d.name}: manifest format {manifest.get('format')!r}, expected {FORMAT_VERSION}"]
    outside = [why for rel in manifest["files"] if (why := escape_error(d, rel))]
    if outside:  # nothing outside the directory is read, not even its size
        return outside
    bad = list(_file_problems(d, manifest["files"], checksums))
    if bad or DCP_METADATA not in manifest["files"]:
        return bad
    from meshrun.checkpoint.safe_metadata import metadata_problems  # torch: only here

    return metadata_problems(d, set(manifest["files"]))


def escape_error(directory: Path, rel: Any) -> str | None:
    """Why the manifest entry ``rel`` is not a file inside ``directory`` (None: it is): an
    absolute path, a ``..`` component, or a symlink (of it or of a folder on its way) that
    resolves outside. Read as is, such an entry would have ``verify`` hash and ``export`` read
    a file anywhere on the machine."""
    where = f"{Path(directory).name}/{MANIFEST}"
    if not isinstance(rel, str) or not rel:
        return f"{where}: entry {rel!r} is not a file name"
    if rel.startswith(("/", "\\")) or ".." in re.split(r"[/\\]", rel) or Path(rel).is_absolute():
        return f"{where}: entry {rel!r} points outside the checkpoint directory (refused)"
    root = Path(directory).resolve()
    if not (root / rel).resolve().is_relative_to(root):
        return (
            f"{where}: entry {rel!r} is a symlink resolving outside the checkpoint directory, "
            f"to {(root / rel).resolve()} (refused)"
        )
    return None


def _file_problems(d: Path, files: dict[str, Any], checksums: bool) -> Iterable[str]:
    for rel, want in files.items():
        p = d / rel
        if not p.is_file():
            yield f"{d.name}/{rel}: missing"
            continue
        size = p.stat().st_size
        if size != want["size"]:
            yield f"{d.name}/{rel}: size {size} bytes, manifest says {want['size']} (truncated?)"
        elif checksums and sha256_file(p) != want["sha256"]:
            yield f"{d.name}/{rel}: SHA-256 differs from the manifest (altered)"


def resume_path_error(resume: str) -> str | None:
    """Why ``checkpoint.resume = resume`` (a path) cannot be resumed, or None (also for
    ``auto``/``never``). Cheap (sizes, marker and manifest hash; no checksums), so the launcher
    can refuse a bad path before it spawns anything; the workers still verify the checksums."""
    if resume in ("auto", "never"):
        return None
    bad = problems(Path(resume), checksums=False)
    if not bad:
        return None
    return (
        f"checkpoint.resume = {resume!r} is not a valid checkpoint: {'; '.join(bad)}; pick a "
        "step_N directory from `meshrun ckpt list DIR`, or set checkpoint.resume=auto (the "
        "newest valid one) or never"
    )


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint directory (validity is judged separately by ``problems``)."""

    step: int
    path: Path


def list_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Committed-looking checkpoint directories under ``root``, oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = []
    for p in r.iterdir():
        step = parse_step(p.name)
        if step is not None and p.is_dir():
            found.append(CheckpointInfo(step, p))
    return sorted(found, key=lambda c: c.step)


def retention(
    steps: Iterable[int], *, keep_last: int, keep_every: int, newest_valid: int | None
) -> set[int]:
    """Steps whose checkpoints may be deleted: all but the newest ``keep_last``, the multiples
    of ``keep_every`` (0 = none) and ``newest_valid`` (never deleted, whatever the rules)."""
    ordered = sorted(set(steps))
    keep = set(ordered[-keep_last:]) if keep_last > 0 else set()
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    if newest_valid is not None:
        keep.add(newest_valid)
    return set(ordered) - keep
