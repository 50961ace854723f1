"""Data: a sampler whose order does not depend on the world size, its loader, token shards."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.data.dataset import TokenDataset
    from meshrun.data.iterable import ResumableIterable
    from meshrun.data.loader import build_dataloader
    from meshrun.data.sampler import ResumableSampler

__getattr__ = lazy_exports(
    globals(),
    {
        "TokenDataset": "meshrun.data.dataset",
        "ResumableIterable": "meshrun.data.iterable",
        "build_dataloader": "meshrun.data.loader",
        "ResumableSampler": "meshrun.data.sampler",
    },
)

__all__ = ["ResumableIterable", "ResumableSampler", "TokenDataset", "build_dataloader"]
