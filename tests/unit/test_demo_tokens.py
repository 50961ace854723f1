"""The demo's corpus through meshrun's data pipeline: the stdlib files as byte-tokenized shards
(each file + end-of-document 256, vocabulary 257), prepared once and reused, read back by
TokenDataset as ``{"input", "target"}`` long tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshrun.data import TokenDataset
from meshrun.data.shards import load_manifest
from meshrun.demo.corpus import EOT, decode, demo_tokens_dir, prepare_demo_tokens, stdlib_files

_LIMIT = 300_000


def test_shards_hold_the_stdlib_files_each_ended_by_eot(tmp_path: Path) -> None:
    out = prepare_demo_tokens(tmp_path, _LIMIT)
    assert out == demo_tokens_dir(tmp_path, _LIMIT)
    m = load_manifest(out)
    assert (m.tokenizer, m.vocab_size, m.eot) == ("bytes", 257, EOT)
    expected = b"".join(p.read_bytes() + b"\0" for p in stdlib_files(_LIMIT))
    want = np.frombuffer(expected, dtype=np.uint8).astype(np.int64)
    want[np.cumsum([p.stat().st_size + 1 for p in stdlib_files(_LIMIT)]) - 1] = EOT
    got = TokenDataset(out, 64).read(0, m.total_tokens).astype(np.int64)
    assert m.total_tokens >= _LIMIT and np.array_equal(got, want)
    assert not list(tmp_path.glob("*.src"))  # the link tree is cleaned up


def test_prepared_once_then_reused(tmp_path: Path) -> None:
    out = prepare_demo_tokens(tmp_path, _LIMIT)
    shard = next(out.glob("shard_*.npy"))
    before = shard.stat().st_mtime_ns
    assert prepare_demo_tokens(tmp_path, _LIMIT) == out
    assert shard.stat().st_mtime_ns == before  # not rewritten
    assert demo_tokens_dir(tmp_path, 2 * _LIMIT) != out  # another corpus, another directory


def test_demo_split_items_and_decode(tmp_path: Path) -> None:
    train, val = TokenDataset(prepare_demo_tokens(tmp_path, _LIMIT), 32).split(0.02)
    assert train.hi == val.lo and len(train) > 40 * len(val) > 0  # validation: a 2 % tail
    item = train[3]
    assert set(item) == {"input", "target"}
    assert item["input"].dtype == torch.long and item["input"].shape == (32,)
    assert torch.equal(item["input"][1:], item["target"][:-1])
    assert decode(torch.tensor([100, 101, EOT, 102])) == "de\n\nf"
