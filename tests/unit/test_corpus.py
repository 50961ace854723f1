"""The demo corpus: deterministic, right files, aligned windows, disjoint train/val split."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshrun.demo import corpus
from meshrun.demo.corpus import ByteWindows, build_demo_datasets, decode, load_corpus

_EXCLUDED = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
_LIMIT = 300_000  # enough to span several files, small enough to be quick


def test_load_is_deterministic() -> None:
    a, b = load_corpus(_LIMIT), load_corpus(_LIMIT)
    assert a.dtype == torch.uint8 and a.shape == (_LIMIT,)
    assert torch.equal(a, b)
    assert torch.equal(load_corpus(1000), a[:1000])  # a smaller corpus is a prefix


def test_corpus_is_the_files_in_order() -> None:
    files = corpus.stdlib_files(_LIMIT)
    expected = b"\n\n".join(p.read_bytes() for p in files)[:_LIMIT]
    assert bytes(load_corpus(_LIMIT).tolist()) == expected
    assert decode(load_corpus(_LIMIT)[:20]) == expected[:20].decode()


def test_real_stdlib_file_list_excludes_tests_and_packages() -> None:
    root = corpus._stdlib_root()
    files = corpus.stdlib_files(10**12)  # the whole standard library
    rel = [p.relative_to(root).as_posix() for p in files]
    assert len(files) > 100
    assert rel == sorted(rel)
    assert all(r.endswith(".py") for r in rel)
    for r in rel:
        assert not _EXCLUDED & set(r.split("/")[:-1]), r


def _fake_stdlib(root: Path) -> None:
    for rel in [
        "b.py",
        "a.py",
        "a/z.py",
        "test/t.py",
        "pkg/tests/t.py",
        "pkg/mod.py",
        "site-packages/x.py",
        "idlelib/i.py",
        "lib2to3/l.py",
        "notes.txt",
    ]:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rel.encode() * 10)
    (root / "broken.py").symlink_to(root / "missing.py")  # unreadable: must be skipped


def test_file_selection_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_stdlib(tmp_path)
    monkeypatch.setattr(corpus, "_stdlib_root", lambda: tmp_path)
    rel = [p.relative_to(tmp_path).as_posix() for p in corpus.stdlib_files(10**6)]
    assert rel == ["a.py", "a/z.py", "b.py", "pkg/mod.py"]
    # The limit stops at the file that reaches it: a.py alone is 40 bytes (+2 separator).
    assert len(corpus.stdlib_files(40)) == 1
    assert len(corpus.stdlib_files(43)) == 2


def test_too_small_stdlib_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_stdlib(tmp_path)
    monkeypatch.setattr(corpus, "_stdlib_root", lambda: tmp_path)
    assert load_corpus(50).numel() == 50  # asked for little, got it: fine
    with pytest.raises(RuntimeError, match="standard library"):
        load_corpus(4_000_000)


def test_windows_line_up() -> None:
    data = load_corpus(_LIMIT)
    ds = ByteWindows(data, seq_len=64)
    assert len(ds) == (_LIMIT - 1) // 64
    for i in (0, 1, len(ds) - 1):
        item = ds[i]
        assert item["input"].dtype == torch.long and item["input"].shape == (64,)
        assert torch.equal(item["input"], data[i * 64 : i * 64 + 64].long())
        assert torch.equal(item["target"][:-1], item["input"][1:])
        assert item["target"][-1] == data[i * 64 + 64]
    assert torch.equal(ds[1]["input"][0:1], ds[0]["target"][-1:])  # non-overlapping, contiguous
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_train_val_disjoint_by_position() -> None:
    train, val = build_demo_datasets(seq_len=64, limit_bytes=_LIMIT, val_fraction=0.1)
    data = load_corpus(_LIMIT)
    assert torch.equal(torch.cat([train.data, val.data]), data)  # train is a prefix, val the tail
    assert val.data.numel() == int(_LIMIT * 0.1)
    # The last train target is still inside the train slice, so no val byte is ever trained on.
    assert (len(train) - 1) * 64 + 64 < train.data.numel()
    assert len(train) > 0 and len(val) > 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        ByteWindows(torch.zeros(10, dtype=torch.uint8), seq_len=10)
    with pytest.raises(ValueError, match="uint8"):
        ByteWindows(torch.zeros(100, dtype=torch.long), seq_len=10)
    with pytest.raises(ValueError, match="val_fraction"):
        build_demo_datasets(seq_len=64, limit_bytes=_LIMIT, val_fraction=1.0)
    with pytest.raises(ValueError, match="limit_bytes"):
        load_corpus(0)
