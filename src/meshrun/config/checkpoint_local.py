"""The checks of the node-local checkpoint tier's keys (``checkpoint.local_*``) that involve
more than one key or the shape of a path; ``CheckpointConfig.__post_init__`` runs them.

The tier (meshrun/checkpoint/local/tier.py, docs/checkpoint.md) is the frequent, fast one;
``checkpoint.interval`` stays the durable one, so a local interval at or above it is refused.
"""

from __future__ import annotations

import string
from pathlib import PurePosixPath
from typing import Any

from meshrun.config.fields import ConfigError

__all__ = ["NODE_FIELD", "check_local_tier"]

NODE_FIELD = "node"  # local_dir may name "{node}": the node index (simulated nodes on one host)


def check_local_tier(cfg: Any) -> None:
    """Raise a ConfigError naming the key, the value, what is allowed and the fix."""
    errors = [e for e in (_dir_error(cfg.local_dir, cfg.dir), _interval_error(cfg)) if e]
    if errors:
        raise ConfigError("; ".join(errors))


def _dir_error(local_dir: str, shared_dir: str) -> str | None:
    if not local_dir:
        return None
    if not PurePosixPath(local_dir).is_absolute():
        return (
            f"checkpoint.local_dir = {local_dir!r} is not allowed: expected an absolute path on "
            "node-local storage (e.g. --checkpoint.local_dir=/dev/shm/meshrun or a local NVMe "
            "mount), or empty for the default under /dev/shm"
        )
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(local_dir) if f is not None}
    except ValueError as e:
        fields = {f"<{e}>"}
    if fields - {NODE_FIELD}:
        return (
            f"checkpoint.local_dir = {local_dir!r} is not allowed: the only placeholder is "
            f"'{{{NODE_FIELD}}}' (the node index), found {sorted(fields - {NODE_FIELD})}; "
            "remove the other braces"
        )
    if shared_dir and PurePosixPath(local_dir) == PurePosixPath(shared_dir):
        return (
            f"checkpoint.local_dir = {local_dir!r} is checkpoint.dir: the node-local tier needs "
            "a directory of its own on node-local storage (e.g. /dev/shm/meshrun)"
        )
    return None


def _interval_error(cfg: Any) -> str | None:
    local, shared = cfg.local_interval, cfg.interval
    if local == 0 or shared == 0 or local < shared:
        return None
    return (
        f"checkpoint.local_interval = {local} is not allowed with checkpoint.interval = {shared}: "
        "the node-local snapshots are the frequent tier and the shared checkpoint the durable "
        f"one, so local_interval must be below interval (e.g. --checkpoint.local_interval="
        f"{max(1, shared // 4)}), or 0 to turn the local tier off"
    )
