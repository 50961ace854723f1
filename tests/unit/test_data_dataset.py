"""TokenDataset: windows by global index across shards, lazy maps, split, errors."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from meshrun.data import ResumableSampler, TokenDataset, build_dataloader
from meshrun.data.prepare import prepare


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tokens")
    (root / "in").mkdir()
    for i in range(5):
        # every byte value but NUL (data prepare refuses a NUL: a binary file)
        (root / "in" / f"{i}.txt").write_bytes(bytes(range(1, 256)) * (3 + i))
    prepare(root / "in", root / "out", shard_tokens=1000, workers=1, log=lambda _: None)
    return root / "out"


def stream(directory: Path) -> np.ndarray:
    return np.concatenate([np.load(p) for p in sorted(directory.glob("shard_*.npy"))])


def test_windows_are_the_stream_by_global_index(data_dir: Path) -> None:
    ds, tokens = TokenDataset(data_dir, seq_len=100), stream(data_dir)
    assert len(ds) == (tokens.size - 1) // 100
    for i in (0, 9, 10, len(ds) - 1):  # 9 -> 900..1001 crosses the first shard boundary
        item = ds[i]
        assert item["input"].dtype == torch.long and item["input"].shape == (100,)
        assert np.array_equal(item["input"].numpy(), tokens[i * 100 : i * 100 + 100])
        assert np.array_equal(item["target"].numpy(), tokens[i * 100 + 1 : i * 100 + 101])
    assert torch.equal(ds[-1]["input"], ds[len(ds) - 1]["input"])
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]


def test_shards_are_mapped_lazily_and_not_pickled(data_dir: Path) -> None:
    ds = TokenDataset(data_dir, seq_len=100)
    assert ds.mapped_shards == []
    ds[25]  # tokens 2500..2601: the third shard only
    assert ds.mapped_shards == [2]
    assert isinstance(ds._shard(2), np.memmap)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.mapped_shards == [] and torch.equal(clone[25]["input"], ds[25]["input"])


def test_split_is_disjoint_and_covers_the_tail(data_dir: Path) -> None:
    ds = TokenDataset(data_dir, seq_len=64)
    train, val = ds.split(0.1)
    assert train.lo == 0 and train.hi == val.lo and val.hi == ds.hi
    assert val.hi - val.lo == int(ds.hi * 0.1)
    assert train.lo + len(train) * 64 + 1 <= train.hi  # no train target inside val
    assert torch.equal(
        val[0]["input"], torch.from_numpy(stream(data_dir)[val.lo : val.lo + 64].astype(np.int64))
    )


def test_a_rank_maps_only_the_shards_of_its_samples(data_dir: Path) -> None:
    """Rank 1 of 4 reading two global batches touches only the shards its 2 samples lie in."""
    ds = TokenDataset(data_dir, seq_len=100)
    sampler = ResumableSampler(len(ds), rank=1, world_size=4, global_batch=4, seed=3)
    loader = build_dataloader(ds, sampler, 1)
    taken = [i for _, i in zip(range(2), sampler, strict=False)]
    for _, _ in zip(range(2), loader, strict=False):  # range first: zip pulls no third batch
        pass
    # Window i spans tokens [100 i, 100 i + 101): shard 100 i // 1000 and maybe the next.
    expected = {t // 1000 for i in taken for t in (100 * i, 100 * i + 100)}
    assert ds.mapped_shards == sorted(expected)
    assert len(expected) < len(ds.manifest.shards)


def test_bad_arguments_name_the_value(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seq_len=0"):
        TokenDataset(data_dir, seq_len=0)
    with pytest.raises(ValueError, match="seq_len \\+ 1"):
        TokenDataset(data_dir, seq_len=10**7)
    with pytest.raises(ValueError, match="tokens=\\(5, 2\\)"):
        TokenDataset(data_dir, seq_len=1, tokens=(5, 2))
    with pytest.raises(FileNotFoundError, match="meshrun data prepare"):
        TokenDataset(tmp_path, seq_len=8)
    with pytest.raises(ValueError, match="val_fraction"):
        TokenDataset(data_dir, seq_len=8).split(1.5)


def test_verify_flag_rejects_a_corrupt_shard(tmp_path: Path, data_dir: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(data_dir, copy)
    with (copy / "shard_000001.npy").open("r+b") as fh:
        fh.seek(300)
        fh.write(b"\x01\x02")
    TokenDataset(copy, seq_len=8)  # without verify: opens (checks cost a full read)
    with pytest.raises(ValueError, match=r"shard_000001\.npy: sha256"):
        TokenDataset(copy, seq_len=8, verify=True)
