"""The demo's training text: the local Python standard library, read as raw bytes.

Every machine that runs meshrun already has a few megabytes of well-written Python source in
its standard library, so the demo needs no download and works on clusters without internet.
Files are taken in sorted relative-path order, so the same Python installation always yields
the same corpus, byte for byte, on every rank and every node. Tests, IDLE, lib2to3 and any
installed third-party packages are left out: they are either huge and repetitive or not part of
the standard library at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

# Directory names never descended into, wherever they appear in the tree.
_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "__pycache__",
        # codec lookup tables: megabytes of repetitive data that would fill the validation tail
        "encodings",
    }
)
_SEPARATOR = b"\n\n"
_MIN_BYTES = 100_000  # below this the demo would only memorise; better to fail clearly


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _candidate_files(root: Path) -> list[Path]:
    """Every ``*.py`` under ``root`` outside the skipped directories, in relative-path order."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # prune: never descend
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    # Sort on the POSIX relative path, not on os.walk order, which depends on the filesystem.
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_files(limit_bytes: int) -> list[tuple[Path, bytes]]:
    """Read candidate files in order until ``limit_bytes`` (separators included) is reached."""
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes={limit_bytes}: must be positive")
    chunks: list[tuple[Path, bytes]] = []
    total = 0
    for path in _candidate_files(_stdlib_root()):
        if total >= limit_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:  # unreadable: permissions, a broken link, a file removed meanwhile
            continue
        if data:  # empty __init__.py files would only add separators
            chunks.append((path, data))
            total += len(data) + len(_SEPARATOR)
    return chunks


def stdlib_files(limit_bytes: int) -> list[Path]:
    """The standard-library ``.py`` files that make up a corpus of ``limit_bytes`` bytes."""
    return [path for path, _ in _read_files(limit_bytes)]


def load_corpus(limit_bytes: int = 4_000_000) -> Tensor:
    """The first ``limit_bytes`` bytes of the stdlib corpus as a 1-D uint8 tensor.

    Files are joined with a blank line between them. If the standard library holds fewer
    bytes than asked, all of it is returned; under 100 kB that is too little to train on and
    a RuntimeError is raised.
    """
    text = _SEPARATOR.join(data for _, data in _read_files(limit_bytes))[:limit_bytes]
    if len(text) < min(limit_bytes, _MIN_BYTES):
        raise RuntimeError(
            f"only {len(text)} bytes of Python source found under {_stdlib_root()} "
            f"(asked for {limit_bytes}, need at least {_MIN_BYTES}); "
            "is the standard library's source installed?"
        )
    # bytearray, not bytes: torch.frombuffer wants a writable buffer.
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


class ByteWindows(Dataset[dict[str, Tensor]]):
    """Non-overlapping windows of ``seq_len`` bytes; the target is the input shifted by one.

    Item ``i`` covers bytes ``[i * seq_len, (i + 1) * seq_len]`` (one extra for the last
    target), so each byte is predicted exactly once per epoch.
    """

    def __init__(self, data: Tensor, seq_len: int) -> None:
        if data.dim() != 1 or data.dtype != torch.uint8:
            raise ValueError(f"data: expected a 1-D uint8 tensor, got {data.dtype} {data.shape}")
        if seq_len <= 0:
            raise ValueError(f"seq_len={seq_len}: must be positive")
        if data.numel() < seq_len + 1:
            raise ValueError(f"data has {data.numel()} bytes: need at least seq_len + 1")
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        start = i * self.seq_len
        window = self.data[start : start + self.seq_len + 1].long()
        return {"input": window[:-1], "target": window[1:]}


def build_demo_datasets(
    seq_len: int, limit_bytes: int = 4_000_000, val_fraction: float = 0.02
) -> tuple[ByteWindows, ByteWindows]:
    """Train and validation windows over the stdlib corpus; validation is the tail.

    Splitting by position (not by shuffled windows) keeps every validation byte unseen in
    training, which is what makes the validation loss mean something.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}: must be in (0, 1)")
    data = load_corpus(limit_bytes)
    n_val = max(int(data.numel() * val_fraction), seq_len + 1)
    split = data.numel() - n_val
    return ByteWindows(data[:split], seq_len), ByteWindows(data[split:], seq_len)


# The byte tokenizer's end-of-document id (data/tokenizers.py): one past the 256 byte values.
EOT = 256


def decode(ids: Tensor) -> str:
    """Bytes back to text for printing samples; invalid UTF-8 becomes U+FFFD and the
    end-of-document id a blank line (the separator of :func:`load_corpus`)."""
    out = bytearray()
    for i in ids.reshape(-1).tolist():
        out += _SEPARATOR if i == EOT else bytes([i])
    return out.decode("utf-8", errors="replace")


# --- the demo's corpus as token shards (meshrun.data) ---------------------------------------


def demo_tokens_dir(cache_root: str | Path, limit_bytes: int) -> Path:
    """Where :func:`prepare_demo_tokens` puts the corpus of ``limit_bytes``: a directory named
    by a digest of the chosen files (relative paths, sizes, modification times), so another
    Python installation or a changed ``limit_bytes`` gets its own directory instead of
    meeting a dataset made from other inputs. Cheap (a stat per file): every rank can call it.
    """
    root = _stdlib_root()
    entries = [
        [p.relative_to(root).as_posix(), (st := p.stat()).st_size, st.st_mtime_ns]
        for p in stdlib_files(limit_bytes)
    ]
    key = hashlib.sha256(json.dumps([str(root), entries, "bytes"]).encode()).hexdigest()
    return Path(cache_root) / f"stdlib-{key[:16]}"


def prepare_demo_tokens(
    cache_root: str | Path,
    limit_bytes: int,
    log: Callable[[str], None] = lambda s: None,
) -> Path:
    """The stdlib corpus of ``limit_bytes`` as byte-tokenized shards (``meshrun data
    prepare``), made once under ``cache_root`` and reused; returns the shard directory.

    Each file is one document followed by the end-of-document id 256, so the vocabulary is
    257 (the manifest's ``vocab_size``). Whole files are taken until ``limit_bytes`` is
    reached, so the corpus may run a file past it. Call it on one process at a time (the
    demo: rank 0, then a barrier).
    """
    from meshrun.data.prepare import prepare

    out = demo_tokens_dir(cache_root, limit_bytes)
    if (out / "manifest.json").exists():
        return out  # the name is the inputs' digest: a finished directory is this corpus
    # prepare() reads a directory or a glob: a tree of links to the chosen files, in the same
    # relative-path order. Outside `out` (prepare skips inputs under its output).
    links = out.with_name(out.name + ".src")
    shutil.rmtree(links, ignore_errors=True)  # an interrupted earlier try: links are cheap
    root = _stdlib_root()
    files = stdlib_files(limit_bytes)
    if not files:
        raise RuntimeError(f"no Python source found under {root}: is the stdlib installed?")
    for path in files:
        link = links / path.relative_to(root)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)
    # One worker: one ~16 MiB unit for the default 4 MB, and no fork of a process that
    # already holds a process group and threads.
    prepare(links, out, tokenizer="bytes", workers=1, progress=False, log=log)
    shutil.rmtree(links)
    return out
