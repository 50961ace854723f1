"""meshrun data prepare / verify: the token stream, shards, manifest, resume, checksums."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshrun.cli.main import main
from meshrun.data.prepare import list_inputs, prepare
from meshrun.data.shards import load_manifest, verify_dataset
from meshrun.data.tokenizers import ByteTokenizer, get_tokenizer


def make_corpus(root: Path, files: int = 12) -> list[bytes]:
    """Files of different sizes in nested folders; returns their contents in sorted order."""
    texts = []
    for i in range(files):
        path = root / f"d{i % 3}" / f"f{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = f"document {i} ".encode() * (50 + 37 * i)
        path.write_bytes(text)
    (root / ".hidden").write_bytes(b"never read")
    for path in sorted(root.rglob("f*.txt"), key=lambda p: p.relative_to(root).as_posix()):
        texts.append(path.read_bytes())
    return texts


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def quiet(_: str) -> None:
    pass


class FailingBytes(ByteTokenizer):
    """Fails on the ``fail_at``-th document it sees: an interruption midway."""

    def __init__(self, fail_at: int) -> None:
        object.__setattr__(self, "seen", [0])
        object.__setattr__(self, "fail_at", fail_at)

    def encode(self, text: bytes) -> np.ndarray:
        self.seen[0] += 1  # type: ignore[attr-defined]
        if self.seen[0] == self.fail_at:  # type: ignore[attr-defined]
            raise KeyboardInterrupt
        return super().encode(text)


def test_stream_is_documents_and_eot_in_order(tmp_path: Path) -> None:
    texts = make_corpus(tmp_path / "in")
    m = prepare(tmp_path / "in", tmp_path / "out", shard_tokens=1000, workers=1, log=quiet)
    stream = np.concatenate([np.load(tmp_path / "out" / s.file) for s in m.shards])
    expected = b"".join(t + b"\x00" for t in texts)  # placeholder for eot, fixed below
    ids = np.frombuffer(expected, dtype=np.uint8).astype(np.uint16)
    ids[np.cumsum([len(t) + 1 for t in texts]) - 1] = 256
    assert np.array_equal(stream, ids)
    assert m.documents == 12 and m.total_tokens == ids.size and m.dtype == "uint16"
    assert [s.tokens for s in m.shards[:-1]] == [1000] * (len(m.shards) - 1)
    assert 0 < m.shards[-1].tokens <= 1000 and m.tokenizer == "bytes" and m.eot == 256
    assert load_manifest(tmp_path / "out") == m
    assert verify_dataset(tmp_path / "out") == []


def test_parallel_equals_serial_and_units_do_not_matter(tmp_path: Path) -> None:
    make_corpus(tmp_path / "in")
    prepare(tmp_path / "in", tmp_path / "a", shard_tokens=700, workers=1, log=quiet)
    prepare(
        tmp_path / "in", tmp_path / "b", shard_tokens=700, workers=2, unit_bytes=1500, log=quiet
    )
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")


def test_interrupted_then_rerun_is_byte_identical(tmp_path: Path) -> None:
    make_corpus(tmp_path / "in")
    args = {"shard_tokens": 900, "workers": 1, "unit_bytes": 1000}
    prepare(tmp_path / "in", tmp_path / "ref", log=quiet, **args)
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path / "in", tmp_path / "out", tokenizer=FailingBytes(7), log=quiet, **args)
    work = tmp_path / "out" / ".prepare"
    done_before = sorted(p.name for p in work.glob("unit_*.npy"))
    assert 0 < len(done_before) < 12 and not (tmp_path / "out" / "manifest.json").exists()
    lines: list[str] = []
    prepare(tmp_path / "in", tmp_path / "out", log=lines.append, **args)
    assert any(f"{len(done_before)} of" in line and "resuming" in line for line in lines)
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "ref")
    assert not work.exists()


def test_rerun_of_complete_dir_is_a_no_op_and_other_settings_are_an_error(tmp_path: Path) -> None:
    make_corpus(tmp_path / "in")
    first = prepare(tmp_path / "in", tmp_path / "out", shard_tokens=1000, log=quiet)
    assert prepare(tmp_path / "in", tmp_path / "out", shard_tokens=1000, log=quiet) == first
    with pytest.raises(ValueError, match="other inputs or settings"):
        prepare(tmp_path / "in", tmp_path / "out", shard_tokens=999, log=quiet)


def test_corrupt_missing_and_truncated_shards_are_named(tmp_path: Path) -> None:
    make_corpus(tmp_path / "in")
    m = prepare(tmp_path / "in", tmp_path / "out", shard_tokens=1000, log=quiet)
    out = tmp_path / "out"
    raw = bytearray((out / m.shards[1].file).read_bytes())
    raw[-5] ^= 0xFF  # one flipped byte in the token data
    (out / m.shards[1].file).write_bytes(bytes(raw))
    (out / m.shards[2].file).unlink()
    problems = verify_dataset(out)
    assert len(problems) == 2
    assert problems[0].startswith(f"{m.shards[1].file}: sha256") and "does not match" in problems[0]
    assert problems[1] == f"{m.shards[2].file}: missing"


def test_cli_verify_names_the_failing_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_corpus(tmp_path / "in")
    out = tmp_path / "out"
    assert (
        main(["data", "prepare", str(tmp_path / "in"), "--out", str(out), "--shard-tokens", "1000"])
        == 0
    )
    assert main(["data", "verify", str(out)]) == 0
    assert "ok, " in capsys.readouterr().out
    with (out / "shard_000003.npy").open("r+b") as fh:
        fh.seek(200)
        fh.write(b"\xff\xff")
    assert main(["data", "verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert "1 problem(s)" in err and "shard_000003.npy: sha256" in err
    assert main(["data", "verify", str(tmp_path / "in")]) == 2
    assert "not a prepared token dataset" in capsys.readouterr().err


def test_glob_inputs_and_errors(tmp_path: Path) -> None:
    make_corpus(tmp_path / "in")
    files = list_inputs(str(tmp_path / "in" / "**" / "f0*.txt"))
    # Sorted by path: the folder d0 first, then d1, d2.
    assert [p.name for p in files] == [f"f0{i}.txt" for i in (0, 3, 6, 9, 1, 4, 7, 2, 5, 8)]
    assert all(".hidden" not in str(p) for p in list_inputs(tmp_path / "in"))
    with pytest.raises(ValueError, match="matches no files"):
        list_inputs(str(tmp_path / "nothing*"))
    with pytest.raises(ValueError, match="'bytes'"):
        get_tokenizer("sentencepiece:x")


def test_optional_tokenizer_missing_is_a_clear_error() -> None:
    pytest.importorskip("numpy")
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install tiktoken"):
            get_tokenizer("tiktoken:gpt2")
    else:
        assert get_tokenizer("tiktoken:gpt2").vocab_size > 50000


def test_manifest_is_deterministic_json(tmp_path: Path) -> None:
    make_corpus(tmp_path / "in")
    prepare(tmp_path / "in", tmp_path / "a", shard_tokens=1000, log=quiet)
    raw = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert raw["format"] == "meshrun-tokens" and len(raw["shards"][0]["sha256"]) == 64


def test_out_inside_the_source_is_not_read_back_and_stale_shards_go(tmp_path: Path) -> None:
    make_corpus(tmp_path / "in")
    out = tmp_path / "in" / "tokens"
    (out).mkdir()
    (out / "shard_000999.npy").write_bytes(b"left over from an earlier dataset")
    first = prepare(tmp_path / "in", out, shard_tokens=1000, log=quiet)
    assert first.documents == 12  # not its own shards or manifest
    assert not (out / "shard_000999.npy").exists()
    assert prepare(tmp_path / "in", out, shard_tokens=1000, log=quiet) == first
