"""The node-local tier: snapshots in host memory or on a local disk between the shared saves
(``tier``), which rank's copy covers which shard (``rules``), the files and their checksums
(``files``), a lost node's copy fetched from its peer (``p2p``) and the restore (``restore``).
See docs/checkpoint.md."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.checkpoint.local.tier import LocalTier, default_local_dir

__getattr__ = lazy_exports(
    globals(),
    {
        "LocalTier": "meshrun.checkpoint.local.tier",
        "default_local_dir": "meshrun.checkpoint.local.tier",
    },
)

__all__ = ["LocalTier", "default_local_dir"]
