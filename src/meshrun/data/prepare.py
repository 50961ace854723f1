"""``meshrun data prepare``: text files -> fixed-size token shards + manifest, in parallel,
resumable.

The work is cut into *units*: runs of consecutive input files of about ``unit_bytes``,
decided from the sorted file list and the file sizes alone, so every run of the same inputs
makes the same units. Worker processes tokenize units into ``OUT/.prepare/unit_N.npy``
(written to a temporary name, then renamed: a unit file exists only when complete). A rerun
after an interruption finds the finished units and tokenizes only the rest; assembly then
cuts the unit files into shards, so the shards are byte-identical to those of an
uninterrupted run. ``manifest.json`` is written last, and only then is ``.prepare/`` removed:
a directory with a manifest is complete. Disk: the unit files hold a second copy of the
tokens until the end.
"""

from __future__ import annotations

import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshrun.data.shards import (
    MANIFEST,
    Manifest,
    ShardInfo,
    file_sha256,
    load_manifest,
    shard_name,
    write_json_atomic,
)
from meshrun.data.tokenizers import Tokenizer, get_tokenizer, token_dtype

__all__ = ["DEFAULT_SHARD_TOKENS", "list_inputs", "prepare"]

DEFAULT_SHARD_TOKENS = 2**25  # 32 Mi tokens: 64 MiB at uint16, few files, cheap to map
DEFAULT_UNIT_BYTES = 2**24  # ~16 MiB of text per unit: small enough to lose little on a kill
WORK_DIR = ".prepare"


@dataclass(frozen=True)
class _Plan:
    files: list[tuple[str, int, int]]  # (path, size, mtime_ns), in stream order
    units: list[tuple[int, int]]  # [start, stop) into files
    tokenizer: str
    shard_tokens: int

    def digest(self) -> str:
        """What the dataset depends on (not how the work was cut into units)."""
        return _sha256_json([self.files, self.tokenizer, self.shard_tokens])

    def work_digest(self) -> str:
        """What the unit files depend on: the dataset and the units."""
        return _sha256_json([self.digest(), self.units])


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()


def list_inputs(source: str | Path) -> list[Path]:
    """Files of a directory (recursively, hidden ones skipped) or of a glob, in sorted order."""
    root = Path(source)
    if root.is_dir():
        found = [
            p
            for p in root.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
        ]
        files = sorted(found, key=lambda p: p.relative_to(root).as_posix())
    else:
        files = [Path(p) for p in sorted(glob.glob(str(source), recursive=True))]
        files = [p for p in files if p.is_file()]
    if not files:
        raise ValueError(
            f"data prepare: {str(source)!r} matches no files: pass a directory or a glob such "
            "as 'corpus/**/*.txt' (quoted, so the shell does not expand it)"
        )
    return files


def prepare(
    source: str | Path,
    out: str | Path,
    *,
    tokenizer: str | Tokenizer = "bytes",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int = 0,
    unit_bytes: int = DEFAULT_UNIT_BYTES,
    progress: bool | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> Manifest:
    """Tokenize ``source`` into shards under ``out`` and return the manifest (see module doc).

    ``workers`` = 0 uses every core. A finished ``out`` made from the same inputs and settings
    is returned as it is; one made from others is an error rather than a silent overwrite.
    """
    if shard_tokens < 1 or unit_bytes < 1 or workers < 0:
        raise ValueError(
            f"data prepare: shard_tokens ({shard_tokens}) and unit_bytes ({unit_bytes}) must be "
            f">= 1 and workers ({workers}) >= 0"
        )
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(
            f"data prepare: --out {str(out_dir)!r} is a file; give a directory (created if missing)"
        )
    files = _inputs_outside(source, out_dir)
    _refuse_binary(files)
    plan = _make_plan(files, tok.spec, shard_tokens, unit_bytes)
    done = _finished(out_dir, plan)
    if done is not None:
        log(f"data prepare: {out_dir} is already complete ({done.total_tokens} tokens)")
        return done
    work = _work_dir(out_dir, plan)
    _tokenize_units(plan, tok, work, workers, _show_progress(progress), log)
    manifest = _assemble(plan, tok, work, out_dir)
    write_json_atomic(out_dir / MANIFEST, manifest.to_json())
    shutil.rmtree(work)
    _remove_stale_shards(out_dir, manifest)
    log(
        f"data prepare: {manifest.documents} documents -> {manifest.total_tokens} tokens in "
        f"{len(manifest.shards)} shards of {manifest.dtype} at {out_dir}"
    )
    return manifest


def _inputs_outside(source: str | Path, out_dir: Path) -> list[Path]:
    """The inputs, less anything under ``out_dir`` (``--out`` inside the corpus would otherwise
    read its own shards on a rerun)."""
    out_abs = out_dir.resolve()
    files = [p for p in list_inputs(source) if out_abs not in p.resolve().parents]
    if not files:
        raise ValueError(f"data prepare: {str(source)!r} holds no files outside --out {out_dir}")
    return files


BINARY_PROBE_BYTES = 8000  # what git reads to call a file binary: a NUL byte in its start


def _refuse_binary(files: list[Path]) -> None:
    """Text corpora only: a NUL byte in a file's first 8000 bytes (git's test) means an
    archive, an image or a compiled file was matched, whose bytes would train as text."""
    binary = []
    for path in files:
        with path.open("rb") as fh:
            if b"\0" in fh.read(BINARY_PROBE_BYTES):
                binary.append(path)
    if binary:
        raise ValueError(
            f"data prepare: {len(binary)} of {len(files)} input files are binary, not text "
            f"(a NUL byte in the first {BINARY_PROBE_BYTES} bytes), e.g. {str(binary[0])!r}; "
            "narrow the source to text files, e.g. 'corpus/**/*.txt'"
        )


def _remove_stale_shards(out_dir: Path, manifest: Manifest) -> None:
    # Shards of an earlier, larger dataset whose manifest was deleted: not ours, misleading.
    listed = {s.file for s in manifest.shards}
    for path in out_dir.glob("shard_*.npy"):
        if path.name not in listed:
            path.unlink()


def _make_plan(files: list[Path], spec: str, shard_tokens: int, unit_bytes: int) -> _Plan:
    entries = [(str(p), (st := p.stat()).st_size, st.st_mtime_ns) for p in files]
    units: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, (_, nbytes, _) in enumerate(entries):
        size += nbytes
        if size >= unit_bytes:
            units.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(entries):
        units.append((start, len(entries)))
    return _Plan(entries, units, spec, shard_tokens)


def _finished(out_dir: Path, plan: _Plan) -> Manifest | None:
    if not (out_dir / MANIFEST).exists():
        return None
    manifest = load_manifest(out_dir)
    if manifest.source_digest != plan.digest():
        raise ValueError(
            f"data prepare: {out_dir} already holds a dataset made from other inputs or settings "
            "(files, their sizes or times, --tokenizer, --shard-tokens); choose another --out "
            "or delete it"
        )
    return manifest


def _work_dir(out_dir: Path, plan: _Plan) -> Path:
    """``OUT/.prepare``, reused only when it was made for exactly this plan."""
    work = out_dir / WORK_DIR
    stamp = work / "plan.sha256"
    if work.exists() and (not stamp.exists() or stamp.read_text() != plan.work_digest()):
        # Unit files of other inputs would be spliced into this dataset: start over.
        print(
            f"data prepare: {work} is from other inputs or settings; starting over", file=sys.stderr
        )
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    stamp.write_text(plan.work_digest())
    return work


def _unit_path(work: Path, index: int) -> Path:
    return work / f"unit_{index:06d}.npy"


def _tokenize_units(
    plan: _Plan,
    tok: Tokenizer,
    work: Path,
    workers: int,
    progress: bool,
    log: Callable[[str], None],
) -> None:
    todo = [i for i in range(len(plan.units)) if not _unit_path(work, i).exists()]
    if len(todo) < len(plan.units):
        log(
            f"data prepare: resuming, {len(plan.units) - len(todo)} of {len(plan.units)} units done"
        )
    if not todo:
        return
    n = min(workers or (os.cpu_count() or 1), len(todo))
    dtype = token_dtype(tok.vocab_size).str
    jobs = [
        ([f for f, _, _ in plan.files[slice(*plan.units[i])]], str(_unit_path(work, i)))
        for i in todo
    ]
    done = len(plan.units) - len(todo)
    if n == 1:
        with _progress(len(plan.units), done, progress) as advance:
            for files, dest in jobs:
                _tokenize_unit(tok, files, dest, dtype)
                advance()
        return
    # fork: workers start at once, without re-importing meshrun and torch (seconds each).
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(n, mp_context=ctx) as pool:
        # Submitting forks the workers: before the progress bar starts its refresh thread.
        futures: list[Future[None]] = [
            pool.submit(_tokenize_unit, tok, files, dest, dtype) for files, dest in jobs
        ]
        with _progress(len(plan.units), done, progress) as advance:
            for fut in as_completed(futures):
                fut.result()
                advance()


def _tokenize_unit(tok: Tokenizer, files: Sequence[str], dest: str, dtype: str) -> None:
    """Tokenize ``files`` (each followed by end-of-document) into ``dest``, atomically."""
    parts: list[np.ndarray] = []
    for f in files:
        ids = tok.encode(Path(f).read_bytes())
        if ids.size and int(ids.max()) >= tok.vocab_size:
            raise ValueError(f"{f}: token id {int(ids.max())} >= vocab_size {tok.vocab_size}")
        parts += [ids, np.array([tok.eot], dtype=np.uint32)]
    tokens = np.concatenate(parts).astype(dtype)
    tmp = dest + ".tmp.npy"
    np.save(tmp, tokens)
    os.replace(tmp, dest)


def _assemble(plan: _Plan, tok: Tokenizer, work: Path, out_dir: Path) -> Manifest:
    """Cut the unit files, in order, into shards of exactly ``shard_tokens``."""
    dtype = token_dtype(tok.vocab_size)
    shards = [
        _write_shard(out_dir, i, chunk)
        for i, chunk in enumerate(_chunks(work, len(plan.units), plan.shard_tokens, dtype))
    ]
    return Manifest(
        tokenizer=tok.spec,
        vocab_size=tok.vocab_size,
        eot=tok.eot,
        dtype=dtype.name,
        shard_tokens=plan.shard_tokens,
        total_tokens=sum(s.tokens for s in shards),
        documents=len(plan.files),
        source_digest=plan.digest(),
        shards=shards,
    )


def _chunks(work: Path, units: int, size: int, dtype: np.dtype[Any]) -> Iterator[np.ndarray]:
    buf = np.empty(size, dtype=dtype)
    fill = 0
    for i in range(units):
        tokens = np.load(_unit_path(work, i), mmap_mode="r")
        pos = 0
        while pos < tokens.size:
            take = min(size - fill, tokens.size - pos)
            buf[fill : fill + take] = tokens[pos : pos + take]
            fill, pos = fill + take, pos + take
            if fill == size:
                yield buf
                fill = 0
    if fill:
        yield buf[:fill]


def _write_shard(out_dir: Path, index: int, tokens: np.ndarray) -> ShardInfo:
    path = out_dir / shard_name(index)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        np.save(fh, tokens)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return ShardInfo(path.name, int(tokens.size), file_sha256(path))


def _show_progress(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


class _progress:
    """A rich progress bar over units on a terminal; nothing otherwise (the log says the rest)."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._task = self._bar.add_task("tokenizing", total=total, completed=done)

    def __enter__(self) -> Callable[[], None]:
        if self._bar is not None:
            self._bar.start()
        return self._advance

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def _advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)
