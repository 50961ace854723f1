"""Fixed-length token samples over a prepared shard directory, addressed by global index.

Sample ``i`` of a dataset over tokens ``[lo, hi)`` of the stream is the window
``[lo + i * L, lo + i * L + L + 1)``: ``input`` its first ``L`` ids, ``target`` its last
``L`` (the next-token targets). Windows do not overlap, so each token is predicted once per
epoch; a window may cross a shard boundary. Shards are memory-mapped on first use, in the
process that reads them (a DataLoader worker maps its own after fork or spawn), so a rank
touches only the pages of the samples its sampler hands it, and N ranks on one node share
the page cache instead of holding N copies.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from meshrun.data.shards import Manifest, load_manifest, verify_dataset

__all__ = ["TokenDataset"]


class TokenDataset(Dataset[dict[str, Tensor]]):
    """``{"input", "target"}`` long tensors of ``seq_len`` from a ``meshrun data prepare`` dir.

    ``tokens=(lo, hi)`` restricts the dataset to part of the stream (see :meth:`split`);
    ``verify=True`` checks every shard's sha256 first (reads everything once: for start-up
    checks on rank 0, not for every rank).
    """

    def __init__(
        self,
        directory: str | Path,
        seq_len: int,
        *,
        tokens: tuple[int, int] | None = None,
        verify: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.manifest: Manifest = load_manifest(self.directory)
        if verify and (problems := verify_dataset(self.directory)):
            raise ValueError(f"{self.directory}: " + "; ".join(problems))
        total = self.manifest.total_tokens
        lo, hi = (0, total) if tokens is None else tokens
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len}: must be >= 1")
        if not 0 <= lo < hi <= total:
            raise ValueError(f"tokens=({lo}, {hi}): must satisfy 0 <= lo < hi <= {total}")
        if hi - lo < seq_len + 1:
            raise ValueError(
                f"{self.directory} holds {hi - lo} tokens in ({lo}, {hi}): need at least "
                f"seq_len + 1 = {seq_len + 1} for one sample; lower seq_len or add data"
            )
        self.seq_len = seq_len
        self.lo, self.hi = lo, hi
        counts = [s.tokens for s in self.manifest.shards]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return (self.hi - self.lo - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for {n} samples")
        start = self.lo + i * self.seq_len
        window = torch.from_numpy(self.read(start, start + self.seq_len + 1).astype(np.int64))
        return {"input": window[:-1], "target": window[1:]}

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the whole stream, across shard boundaries."""
        parts = []
        while start < stop:
            k = bisect.bisect_right(self._starts, start) - 1
            end = min(stop, self._starts[k + 1])
            offset = start - self._starts[k]
            parts.append(self._shard(k)[offset : offset + end - start])
            start = end
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def split(self, val_fraction: float) -> tuple[TokenDataset, TokenDataset]:
        """Train and validation datasets over disjoint token ranges; validation is the tail.

        Splitting by position keeps every validation token out of training, which a split
        of shuffled samples would not (neighbouring windows share context).
        """
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction}: must be in (0, 1)")
        span = self.hi - self.lo
        cut = self.hi - max(int(span * val_fraction), self.seq_len + 1)
        return self._view(self.lo, cut), self._view(cut, self.hi)

    @property
    def mapped_shards(self) -> list[int]:
        """Indices of the shards this process has mapped so far (what it has touched)."""
        return sorted(self._maps)

    def _view(self, lo: int, hi: int) -> TokenDataset:
        return TokenDataset(self.directory, self.seq_len, tokens=(lo, hi))

    def _shard(self, k: int) -> np.ndarray:
        if k not in self._maps:
            path = self.directory / self.manifest.shards[k].file
            self._maps[k] = np.load(path, mmap_mode="r")
        return self._maps[k]

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps are not sent to workers: each process maps the files itself.
        return {**self.__dict__, "_maps": {}}
