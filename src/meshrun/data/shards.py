"""The on-disk token dataset: fixed-size ``.npy`` shards of token ids and ``manifest.json``.

One dataset is one directory::

    OUT/manifest.json        tokenizer, dtype, shard size, every shard's token count and sha256
    OUT/shard_000000.npy     exactly ``shard_tokens`` ids (the last shard may hold fewer)

The token stream is every input document's ids followed by the tokenizer's end-of-document id,
in sorted input order, cut into shards. Shards are plain NumPy files, so ``np.load(path,
mmap_mode="r")`` maps them and every process on a node shares one page-cache copy. The
checksum covers the whole file, header included, so ``verify`` needs no NumPy to be trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "MANIFEST",
    "Manifest",
    "ShardInfo",
    "file_sha256",
    "load_manifest",
    "shard_name",
    "verify_dataset",
    "write_json_atomic",
]

MANIFEST = "manifest.json"
FORMAT = "meshrun-tokens"
VERSION = 1


@dataclass(frozen=True)
class ShardInfo:
    file: str
    tokens: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    tokenizer: str
    vocab_size: int
    eot: int
    dtype: str
    shard_tokens: int
    total_tokens: int
    documents: int
    # A digest of the inputs and settings, so a rerun can tell whether OUT is its own result.
    source_digest: str
    shards: list[ShardInfo] = field(default_factory=list)
    format: str = FORMAT
    version: int = VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"


def shard_name(index: int) -> str:
    return f"shard_{index:06d}.npy"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: Path, text: str) -> None:
    """Write then rename: a crash leaves the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_manifest(directory: str | Path) -> Manifest:
    """Read ``DIR/manifest.json``; errors say what is wrong and how to make a dataset."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: {directory} is not a prepared token dataset; "
            f"make one with `meshrun data prepare INPUTS --out {directory}`"
        )
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
        shards = [ShardInfo(**s) for s in raw.pop("shards")]
        manifest = Manifest(**raw, shards=shards)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path} is not a valid meshrun manifest: {e}") from None
    if manifest.format != FORMAT or manifest.version != VERSION:
        raise ValueError(
            f"{path}: format {manifest.format!r} version {manifest.version} is not supported "
            f"(this meshrun reads {FORMAT!r} version {VERSION}); prepare the data again"
        )
    return manifest


def verify_dataset(directory: str | Path) -> list[str]:
    """Check every shard against the manifest; return one line per failing shard (empty = ok)."""
    root = Path(directory)
    manifest = load_manifest(root)
    problems = [p for s in manifest.shards if (p := _check_shard(root, s, manifest.dtype))]
    counted = sum(s.tokens for s in manifest.shards)
    if counted != manifest.total_tokens:
        problems.append(
            f"{MANIFEST}: shard token counts sum to {counted}, total_tokens says "
            f"{manifest.total_tokens}"
        )
    return problems


def _check_shard(root: Path, shard: ShardInfo, dtype: str) -> str:
    path = root / shard.file
    if not path.is_file():
        return f"{shard.file}: missing"
    digest = file_sha256(path)
    if digest != shard.sha256:
        return f"{shard.file}: sha256 {digest[:16]}... does not match the manifest's {shard.sha256[:16]}..."
    arr = np.load(path, mmap_mode="r")
    if arr.dtype != np.dtype(dtype) or arr.shape != (shard.tokens,):
        return (
            f"{shard.file}: holds {arr.dtype} {arr.shape}, manifest says {dtype} ({shard.tokens},)"
        )
    return ""
