"""Silent data corruption caught: every ``monitor.replica_check_every`` optimizer steps, the
data-parallel replicas compare a digest of their parameters in one small all-gather, and a
replica whose parameter differs is named (rank, host, parameter) and the run stops on every
rank together.

Which ranks must hold equal parameters (docs/monitor.md, "Replica check"):
- a plain parameter of a DDP module (DDP, ZeRO-1, DDP inside a pipeline stage): every rank of
  the module's process group (the data-parallel ranks);
- a DTensor parameter (FSDP2): the ranks along its mesh's ``dp_replicate`` dim when its
  placement there is ``Replicate`` (HSDP: each shard is held by every replica); ZeRO-2/3
  without ``dp_replicate``, tensor-parallel and expert-parallel shards have no equal copy
  across data parallelism that this check can see and are not checked.

The digest of a parameter is two int64 sums over its bits read as integers (int32 words, or
bytes when its size is not a multiple of 4): the plain sum and the sum weighted by position.
Any single flipped bit changes the plain sum (by +-2^k); a swap of two words changes the
weighted one. Integer sums wrap identically everywhere: the digest is exact, bit for bit,
never a float comparison with a tolerance.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from meshrun.monitor.metrics import MetricsLogger

__all__ = ["Mismatch", "ReplicaCheck", "ReplicaMismatchError", "digest", "find_mismatches"]

log = logging.getLogger("meshrun")

_CHUNK = 1 << 24  # words per chunk: bounds the int64 copy at 128 MiB for any parameter
_WRAPPERS = ("module", "_orig_mod")  # DDP's and torch.compile's wrappers in the names
_SHOWN = 5  # parameters named in the error line (all of them in metrics.jsonl)


class ReplicaMismatchError(RuntimeError):
    """Data-parallel replicas hold different parameters: silent data corruption."""


@dataclass(frozen=True)
class Mismatch:
    """One parameter on which the replicas disagree: ``ranks`` are the odd ones (global
    ranks, with their hosts); ``majority`` False when no value is held by most replicas."""

    name: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    majority: bool

    def text(self) -> str:
        who = ", ".join(f"rank {r} on {h}" for r, h in zip(self.ranks, self.hosts, strict=True))
        if self.majority:
            return f"{self.name!r}: {who} differ(s) from the other replicas"
        return f"{self.name!r}: {who} disagree (no majority: any of them may be the corrupted one)"


def digest(t: torch.Tensor) -> tuple[int, int]:
    """(plain, position-weighted) int64 sums of ``t``'s bits read as integers."""
    flat = t.detach().contiguous().reshape(-1)
    words = flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 else None
    if words is None:
        words = flat.view(torch.uint8)
    plain = torch.zeros((), dtype=torch.int64, device=t.device)
    weighted = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        pos = torch.arange(start + 1, start + 1 + chunk.numel(), device=t.device)
        plain += chunk.sum()
        weighted += (chunk * pos).sum()
    return int(plain), int(weighted)


def find_mismatches(
    names: Sequence[str],
    gathered: Sequence[Sequence[int]],
    ranks: Sequence[int],
    hosts: Sequence[str],
) -> list[Mismatch]:
    """``gathered[i]``: replica ``i``'s digests (2 per parameter, in ``names`` order); the
    parameters on which they differ, each with the replicas outside the largest agreeing set
    (every replica when no set holds a strict majority)."""
    found = []
    for j, name in enumerate(names):
        values = [tuple(g[2 * j : 2 * j + 2]) for g in gathered]
        counts = Counter(values)
        if len(counts) == 1:
            continue
        common, n = counts.most_common(1)[0]
        majority = 2 * n > len(values)
        odd = [i for i, v in enumerate(values) if not majority or v != common]
        found.append(
            Mismatch(name, tuple(ranks[i] for i in odd), tuple(hosts[i] for i in odd), majority)
        )
    return found


class ReplicaCheck:
    """The periodic check; ``every`` = 0: off (nothing is computed, no collective)."""

    def __init__(self, every: int, hostname: str, metrics: MetricsLogger) -> None:
        self.every, self.hostname, self.metrics = every, hostname, metrics
        self._hosts: dict[ProcessGroup, list[str]] = {}
        self._said_unchecked = False

    def maybe_check(self, step: int, models: Sequence[nn.Module]) -> None:
        """At every ``every``-th step (call it on every rank after each optimizer step)."""
        if self.every <= 0 or step % self.every or not dist.is_initialized():
            return
        by_group = replica_params(models)
        if not by_group:
            self._say_unchecked()
        for group, params in by_group.items():
            self._check(step, group, params)

    def _check(
        self, step: int, group: ProcessGroup, params: list[tuple[str, torch.Tensor]]
    ) -> None:
        if dist.get_world_size(group) < 2:
            return
        device = params[0][1].device
        mine = torch.tensor([d for _, p in params for d in digest(p)], dtype=torch.int64)
        mine = mine.to(device) if device.type == "cuda" else mine
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, mine, group=group)
        gathered = [t.cpu().tolist() for t in out]
        if all(g == gathered[0] for g in gathered):
            return
        ranks = dist.get_process_group_ranks(group)
        found = find_mismatches([n for n, _ in params], gathered, ranks, self._group_hosts(group))
        self._stop(step, found)

    def _group_hosts(self, group: ProcessGroup) -> list[str]:
        if group not in self._hosts:
            hosts: list[object] = [None] * dist.get_world_size(group)
            dist.all_gather_object(hosts, self.hostname, group=group)
            self._hosts[group] = [str(h) for h in hosts]
        return self._hosts[group]

    def _stop(self, step: int, found: list[Mismatch]) -> None:
        """Every replica of the group saw the same digests: all raise at the same step."""
        self.metrics.log_event(
            "replica_mismatch",
            step=step,
            params=[
                {"name": m.name, "ranks": list(m.ranks), "hosts": list(m.hosts)} for m in found
            ],
        )
        shown = "; ".join(m.text() for m in found[:_SHOWN])
        more = f" (+{len(found) - _SHOWN} more in metrics.jsonl)" if len(found) > _SHOWN else ""
        raise ReplicaMismatchError(
            f"silent data corruption: data-parallel replicas hold different parameters at step "
            f"{step}: {shown}{more}; stopping (monitor.replica_check_every); check the named hosts' "
            "GPU and memory, then resume from the last good checkpoint"
        )

    def _say_unchecked(self) -> None:
        if not self._said_unchecked and self.metrics.is_main:
            self._said_unchecked = True
            log.info(
                "replica check: no parameter has a data-parallel replica under this layout "
                "(ZeRO-2/3 without dp_replicate, or one data-parallel rank): nothing to compare"
            )


def replica_params(
    models: Sequence[nn.Module],
) -> dict[ProcessGroup, list[tuple[str, torch.Tensor]]]:
    """The parameters with data-parallel replicas, by the group over which they are equal
    (the module docstring says which), as local tensors with their names."""
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    out: dict[ProcessGroup, list[tuple[str, torch.Tensor]]] = {}
    for model in models:
        ddp_group = model.process_group if isinstance(model, DistributedDataParallel) else None
        for name, p in model.named_parameters():
            group, local = ddp_group, cast(torch.Tensor, p)
            if isinstance(p, DTensor):
                group, local = _replicate_group(p), p.to_local()
            if group is not None:
                out.setdefault(group, []).append((_clean(name), local))
    return out


def _replicate_group(p: torch.Tensor) -> ProcessGroup | None:
    mesh, placements = p.device_mesh, p.placements  # type: ignore[attr-defined]
    names = mesh.mesh_dim_names or ()
    for dim, (name, placement) in enumerate(zip(names, placements, strict=True)):
        if name == "dp_replicate" and placement.is_replicate():
            return mesh.get_group(dim)
    return None


def _clean(name: str) -> str:
    """The user's own name: without the wrappers' leading ``module.`` / ``_orig_mod.``."""
    parts = name.split(".")
    while len(parts) > 1 and parts[0] in _WRAPPERS:
        parts = parts[1:]
    return ".".join(parts)
