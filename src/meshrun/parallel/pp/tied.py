"""Tied parameters across pipeline stages, kept tied (Megatron-LM's tied word embeddings).

nanoGPT's and GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``: one tensor in one
process. Split into stages, the embedding lives on the first stage and the head on the last,
each rank holding its own copy; stepped apart they drift (a silently different model). So
every rank that holds one copy joins a 2-rank group with the rank that holds the other (same
position on the non-pp dims), and:

- before training the copies are made equal: the first name's values are broadcast;
- every micro-batch the two copies' gradients are summed over the pair (:func:`sync_tied_grads`,
  after the schedule, so after FSDP's reduce over dp): both then hold the gradient one process
  would give the one tensor, and the same optimizer update keeps them bitwise equal, in memory
  and in checkpoints (each stage writes its own name, with equal values);
- the copy under the second name is marked ``meshrun_tied_replica`` so that gradient clipping
  counts the tied gradient once, as one process does.

Refused before training, with the reason: a pair on two stages of one rank (looped
schedules with the pair's stages pp apart, and V-shaped ones: the first and last stage share
rank 0) and copies split differently (tensor parallel that shards the embedding and the
head on other dims).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun.config import ConfigError
from meshrun.parallel.kinds import is_dtensor as _is_dtensor
from meshrun.parallel.pp.stages import StageParts

__all__ = ["TiedCopy", "bind_tied", "plan_tied", "sync_tied_grads"]


@dataclass(frozen=True)
class TiedPair:
    """A tied pair whose names land on two stages (stage indices over the whole pipeline)."""

    fqns: tuple[str, str]
    stages: tuple[int, int]
    ranks: tuple[int, int]  # the pp ranks that hold them


@dataclass
class TiedCopy:
    """This rank's copy of a tied pair: the stage module that holds it, its FQN there, and the
    2-rank group with the rank holding the other copy."""

    pair: TiedPair
    fqn: str
    stage: nn.Module
    group: dist.ProcessGroup
    src: int  # global rank of the first name's copy: its values are the ones kept

    @property
    def param(self) -> nn.Parameter:
        # Looked up each time: FSDP2 / TP replace the Parameter objects in place.
        return self.stage.get_parameter(self.fqn)


def _stage_of(fqn: str, parts: Sequence[StageParts]) -> int:
    module = fqn.rpartition(".")[0]
    for i, p in enumerate(parts):
        if any(module == f or module.startswith(f + ".") for f in p.fqns):
            return i
    raise ConfigError(f"parallel.pp: the tied parameter {fqn} is on no pipeline stage")


def plan_tied(
    tied: Sequence[tuple[str, str]],
    parts: Sequence[StageParts],
    rank_of: Callable[[int], int],
) -> list[TiedPair]:
    """The tied pairs that span two stages (a pair inside one stage stays one tensor);
    ``rank_of``: the pp rank of a stage (parallel/pp/placement.py)."""
    pairs = []
    for a, b in tied:
        sa, sb = _stage_of(a, parts), _stage_of(b, parts)
        if sa == sb:
            continue
        if rank_of(sa) == rank_of(sb):
            raise ConfigError(
                f"parallel.pp: the tied parameters {a} (stage {sa}) and {b} (stage {sb}) land "
                f"on two stages of one rank ({len(parts)} stages, pp rank {rank_of(sa)}); "
                "meshrun keeps ties between ranks only: use parallel.pp_schedule=1f1b or "
                "gpipe, or untie them"
            )
        pairs.append(TiedPair((a, b), (sa, sb), (rank_of(sa), rank_of(sb))))
    return pairs


def _pair_groups(
    pairs: Sequence[TiedPair], mesh: DeviceMesh, pp: int
) -> dict[tuple[int, int], dist.ProcessGroup]:
    """For each pair of pp ranks, this rank's 2-rank group. Every rank creates every group
    (``new_group`` is collective over the world), in one order."""
    names = list(mesh.mesh_dim_names or ())
    rows = mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, pp).tolist()
    me = dist.get_rank()
    mine: dict[tuple[int, int], dist.ProcessGroup] = {}
    for key in sorted({p.ranks for p in pairs}):
        for row in rows:
            ranks = [row[key[0]], row[key[1]]]
            group = dist.new_group(ranks)
            if me in ranks:
                mine[key] = group
    return mine


def bind_tied(
    pairs: Sequence[TiedPair], modules: Sequence[nn.Module], ids: Sequence[int], mesh: DeviceMesh
) -> list[TiedCopy]:
    """This rank's copies (``modules``: its parallelized stages, ``ids``: their indices), each
    with its pair group; checked alike on every rank, then the values made equal."""
    pp = mesh["pp"].size()
    groups = _pair_groups(pairs, mesh, pp)
    pp_group = mesh["pp"].get_group()
    copies = []
    for pair in pairs:
        key = pair.ranks
        src = dist.get_global_rank(pp_group, key[0])
        for fqn, stage_id in zip(pair.fqns, pair.stages, strict=True):
            if stage_id in ids:
                stage = modules[ids.index(stage_id)]
                copies.append(TiedCopy(pair, fqn, stage, groups[key], src))
    _check_alike(copies)
    for c in copies:
        if c.fqn == c.pair.fqns[1]:
            c.param.meshrun_tied_replica = True  # type: ignore[attr-defined]  # clip: count once
        with torch.no_grad():
            dist.broadcast(_local(c.param), src=c.src, group=c.group)
    return copies


def _local(t: Tensor) -> Tensor:
    with torch.no_grad():  # without grad mode to_local() returns the local tensor itself
        return t.to_local() if _is_dtensor(t) else t


def _layout(p: Tensor) -> str:
    placements = str(p.placements) if _is_dtensor(p) else "plain"
    return f"{placements} local {tuple(_local(p).shape)}"


def _check_alike(copies: Sequence[TiedCopy]) -> None:
    """Both copies of each pair must be split alike (a sum of local gradients is then the
    sum of the whole ones). Gathered over the world, so every rank refuses together."""
    mine = [(c.pair.fqns, c.fqn, _layout(c.param)) for c in copies]
    every: list[list[tuple[tuple[str, str], str, str]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    layouts: dict[tuple[str, str], dict[str, set[str]]] = {}
    for rows in every:
        for fqns, fqn, layout in rows or []:
            layouts.setdefault(fqns, {}).setdefault(fqn, set()).add(layout)
    for (a, b), by_name in layouts.items():
        if by_name.get(a) != by_name.get(b):
            raise ConfigError(
                f"parallel.pp: the tied parameters {a} and {b} are on two pipeline stages and "
                f"split differently ({a}: {sorted(by_name.get(a, ()))}, {b}: "
                f"{sorted(by_name.get(b, ()))}), so their gradients cannot be summed to keep "
                "them tied; set parallel.tp=1 for this model, or untie them"
            )


def stash_tied_grads(copies: Sequence[TiedCopy]) -> list[Tensor | None]:
    """Set each copy's gradient aside before a micro-batch: only this micro-batch's part is
    summed over the pair (summing what earlier micro-steps left would count it twice)."""
    saved = []
    for c in copies:
        p = c.param
        saved.append(p.grad)
        p.grad = None
    return saved


def sync_tied_grads(copies: Sequence[TiedCopy], saved: Sequence[Tensor | None]) -> None:
    """Sum this micro-batch's gradients of each tied pair over its two ranks, then add back
    what earlier micro-steps left (see :func:`stash_tied_grads`)."""
    for c, old in zip(copies, saved, strict=True):
        p = c.param
        if p.grad is None:  # this copy took no part in this micro-batch's loss
            p.grad = torch.zeros_like(p)
        grad = _local(p.grad)
        dist.all_reduce(grad, group=c.group)
        if old is not None:
            grad.add_(_local(old))
