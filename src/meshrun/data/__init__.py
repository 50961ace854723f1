"""Data: a sampler whose order does not depend on the world size, and its loader."""

from meshrun.data.loader import build_dataloader
from meshrun.data.sampler import ResumableSampler

__all__ = ["ResumableSampler", "build_dataloader"]
