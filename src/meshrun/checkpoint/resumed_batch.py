"""The global batch of the checkpoint a run is about to resume, read before the run starts.

An unset ``data.global_batch`` is derived from the world (micro_batch x data-parallel size). A
run that resumes on another world size must keep the saved run's batch instead (the sampler's
position, the LR schedule and the loss are in its samples per step), so the launcher and
``init()`` take it from the checkpoint's manifest first. Pure: files only, no torch.
"""

from __future__ import annotations

from pathlib import Path

from meshrun.checkpoint.on_disk import list_checkpoints, problems, read_manifest
from meshrun.config import Config

__all__ = ["resume_global_batch"]


def _candidates(cfg: Config) -> list[Path]:
    resume = cfg.checkpoint.resume
    if resume == "never":
        return []
    if resume != "auto":
        return [Path(resume)]
    root = (
        Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else cfg.resolved_run_dir() / "checkpoints"
    )
    return [info.path for info in reversed(list_checkpoints(root))]  # newest first


def _saved_batch(path: Path) -> int | None:
    # Cheap checks only (no checksums): the resume itself verifies the checkpoint it loads.
    if problems(path, checksums=False):
        return None
    try:
        value = read_manifest(path).get("global_batch")
    except ValueError:
        return None
    return value if isinstance(value, int) and value >= 1 else None


def resume_global_batch(cfg: Config) -> str | None:
    """Fill in an unset ``data.global_batch`` in place from the checkpoint that
    ``checkpoint.resume`` would load (auto: the newest that looks valid), and return the line
    that says so; None when the value is set or there is nothing to resume."""
    if cfg.data.global_batch:
        return None
    for path in _candidates(cfg):
        if (saved := _saved_batch(path)) is not None:
            cfg.data.global_batch = saved
            return (
                f"data.global_batch unset: {saved} from the checkpoint it resumes ({path}), "
                "kept whatever the world size; set --data.global_batch=N to change it"
            )
    return None
