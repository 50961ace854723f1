"""Data: a sampler whose order does not depend on the world size, its loader, token shards."""

from meshrun.data.dataset import TokenDataset
from meshrun.data.iterable import ResumableIterable
from meshrun.data.loader import build_dataloader
from meshrun.data.sampler import ResumableSampler

__all__ = ["ResumableIterable", "ResumableSampler", "TokenDataset", "build_dataloader"]
