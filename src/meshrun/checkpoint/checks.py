"""Checks and small helpers of the Checkpointer: which checkpoint to resume, whether its
tensors map onto this run, readable errors, RNG re-seeding and the layout's name."""

from __future__ import annotations

import logging
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.checkpoint import on_disk
from meshrun.data.sampler import mix_seed

__all__ = [
    "CheckpointError",
    "check_keys",
    "first_cause",
    "layout_text",
    "pick",
    "reseed",
    "space_text",
]

log = logging.getLogger("meshrun")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or resumed; the message says which, why and what to do."""


def first_cause(e: BaseException) -> BaseException:
    """DCP wraps every rank's traceback into one long exception; keep the root cause (e.g.
    ``OSError: [Errno 28] No space left on device``) for a one-line message."""
    api = sys.modules.get("torch.distributed.checkpoint.api")  # none before DCP is imported
    if api is None or not isinstance(e, api.CheckpointException):
        return e
    text = str(e)
    m = re.search(r"^(\w*Error: \[Errno \d+\].*)$", text, re.MULTILINE)
    if m:
        return RuntimeError(m.group(1))
    ranks = sorted(e.failures)
    return RuntimeError(repr(e.failures[ranks[0]][0]))


def space_text(path: Path) -> str:
    """Free space where the checkpoint is written: a full disk does not always surface as
    ENOSPC (torch's zip writer may report a position mismatch instead)."""
    try:
        usage = shutil.disk_usage(path if path.exists() else path.parent)
    except OSError:
        return ""
    full = usage.free < min(16 << 20, usage.total // 20)
    return f"; {usage.free / 1e6:.1f} MB free of {usage.total / 1e6:.1f} MB there" + (
        " (disk full)" if full else ""
    )


def pick(root: Path, mode: str) -> str | None:
    if mode == "never":
        return None
    if mode != "auto":
        bad = on_disk.problems(Path(mode))
        if bad:
            raise CheckpointError(
                f"checkpoint.resume = {mode!r} is not a valid checkpoint: {'; '.join(bad)}; "
                "pick another (meshrun ckpt list), or use checkpoint.resume=auto"
            )
        return str(Path(mode))
    for info in reversed(on_disk.list_checkpoints(root)):
        bad = on_disk.problems(info.path)
        if not bad:
            return str(info.path)
        log.warning("skipping checkpoint %s: %s", info.path, "; ".join(bad))
    return None


def check_keys(path: Path, tensors: dict[str, Any], known: set[str] | None = None) -> None:
    """DCP fails on tensors the checkpoint lacks; fail too on tensors this model lacks
    (``known``: flat keys this run maps although this rank does not load them); and on
    dtypes DCP would convert silently (safe_metadata.dtype_casts: float -> float is printed)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from meshrun.checkpoint.safe_metadata import cast_text, dtype_casts, read_metadata

    meta = read_metadata(path)  # DCP's pickle, through the restricted unpickler
    flat, _ = flatten_state_dict(tensors)
    extra = sorted(set(meta.state_dict_metadata) - set(flat) - (known or set()))
    if extra:
        raise CheckpointError(
            f"{path.name} holds {len(extra)} tensor(s) this run's model/optimizer lacks, e.g. "
            f"{extra[:3]}: resume with the same model (or register the same named objects)"
        )
    errors, casts = dtype_casts(meta, flat)
    if errors:
        raise CheckpointError(
            f"{path.name} holds {len(errors)} tensor(s) of another kind than this run's: "
            f"{'; '.join(errors[:5])}; DCP would convert them silently: resume with the model "
            "and state built with the saved dtypes"
        )
    if casts:
        log.warning("%s: cast while loading: %s", path.name, cast_text(casts))


def reseed(seed: int, step: int, rank: int) -> None:
    """Per-rank RNG streams after a change of world size (old streams cannot be mapped); the
    loop then gives torch one stream per data-parallel coordinate (loop.seed_per_dp)."""
    s = mix_seed(seed, step, rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def ddp_replay_note(model: nn.Module | None) -> str | None:
    """Why steps replayed after a resume under DDP are not bitwise the interrupted run's, or
    None when they are.

    A new DDP process reduces its first step in buckets in parameter order, then rebuilds them
    in the order gradients became ready (unless ``find_unused_parameters`` without
    ``static_graph``); on more than 2 ranks the ring all-reduce's summation order depends on an
    element's place in the bucket, so the resumed process's first step sums differently than
    the uninterrupted run did at that step (benchmarks/ddp_first_step.py measures it)."""
    if not isinstance(model, DDP):
        return None
    if model.find_unused_parameters and not model.static_graph:
        return None  # DDP keeps its first buckets for the process's life
    ranks = dist.get_world_size(model.process_group)
    if ranks <= 2:
        return None  # a + b is b + a: the order of two terms does not change the sum
    return (
        f"DDP over {ranks} ranks rebuilds its gradient buckets after a process's first step, "
        "so the replayed steps match the interrupted run to float rounding, not bitwise; "
        "--parallel.find_unused_parameters=true keeps one bucket layout (bitwise replays, a "
        "graph search per step)"
    )


def layout_text(model: nn.Module | None) -> str:
    """A short name of the model's data-parallel layout, for the manifest and the plan."""
    if model is None:
        return "unknown"
    if isinstance(model, DDP):
        return "DDP"
    if any(type(m).__name__.startswith("FSDP") for m in model.modules()):
        return "FSDP2"
    return "single"
