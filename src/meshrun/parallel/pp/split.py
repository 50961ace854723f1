"""Where a model splits into pipeline stages, read from its structure (parallel/structure.py).

The blocks are the split points: balanced contiguous runs of blocks (equal blocks: equal
parameters and compute), or the user's ``ModelSpec.split_points`` (FQNs of the blocks that
start a stage, as torchtitan's ``module_fqns_per_model_part``). What runs before the blocks goes
on the first stage, what runs after them on the last, in this order of sources:

1. a Hugging Face model's declared pipeline plan (``config.base_model_pp_plan`` under its
   ``base_model_prefix``, then the class's ``_pp_plan``: embed_tokens -> layers -> norm ->
   lm_head);
2. the modules registered before and after the blocks (``ModelStructure.before/after``: the
   forward order of nanoGPT, GPT-2, torchtitan and the demo).

A Hugging Face model's ``rotary_emb`` goes on every stage (each computes cos/sin).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from meshrun.config import ConfigError
from meshrun.parallel.pp.stages import StageParts
from meshrun.parallel.structure import ModelStructure, is_hf_model

__all__ = ["StageSplit", "split_blocks", "split_model"]


@dataclass(frozen=True)
class StageSplit:
    """Every stage's parts (over the whole pipeline) and where they came from."""

    parts: list[StageParts]
    source: str  # "_pp_plan" or "structure"

    def describe(self) -> str:
        runs = [_run(p.blocks) for p in self.parts]
        first, last = self.parts[0].before, self.parts[-1].after
        return (
            f"[{', '.join(first)}] + {' | '.join(runs)} + [{', '.join(last)}] "
            f"(ends from {self.source})"
        )


def _run(blocks: Sequence[str]) -> str:
    if len(blocks) == 1:
        return blocks[0]
    return f"{blocks[0]}..{blocks[-1].rpartition('.')[2]}"


def split_blocks(n_blocks: int, n_stages: int) -> list[range]:
    """Contiguous, balanced block ranges (equal blocks: equal parameters and compute)."""
    if n_stages > n_blocks:
        raise ConfigError(
            f"parallel.pp x stages per rank = {n_stages} pipeline stages, but the model has only "
            f"{n_blocks} blocks; use at most {n_blocks} stages (lower parallel.pp or "
            "parallel.pp_schedule=1f1b)"
        )
    base, extra = divmod(n_blocks, n_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(n_stages)]
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes, strict=True)]


def _user_ranges(blocks: list[str], points: Sequence[str], n_stages: int) -> list[range]:
    if len(points) != n_stages - 1 or not set(points) <= set(blocks[1:]):
        raise ConfigError(
            f"ModelSpec.split_points = {list(points)}: with {n_stages} pipeline stages give "
            f"{n_stages - 1} FQNs of blocks that start a stage, from {blocks[1]} .. {blocks[-1]}"
        )
    starts = sorted([0, *(blocks.index(p) for p in points)])
    if len(set(starts)) != len(starts):
        raise ConfigError(f"ModelSpec.split_points = {list(points)}: a block is named twice")
    ends = [*starts[1:], len(blocks)]
    return [range(a, b) for a, b in zip(starts, ends, strict=True)]


def _declared_plan(model: nn.Module) -> set[str]:
    """The FQNs in a Hugging Face model's pipeline plan (empty if none). transformers merges
    ``config.base_model_pp_plan`` into the instance's ``_pp_plan`` under the base model's
    prefix; both are read, in case it did not. A set: the plan's dict order is not the
    forward's (the head comes first), the order is the structure's."""
    if not is_hf_model(model):
        return set()
    base = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    prefix = getattr(model, "base_model_prefix", "")
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    fqns = {f"{prefix}.{k}" if has_base else k for k in (base or {})}
    head = getattr(model, "_pp_plan", None)
    return fqns | set(head if isinstance(head, Mapping) else {})


def _ends(model: nn.Module, s: ModelStructure, blocks_fqn: str) -> tuple[list[str], list[str], str]:
    plan = _declared_plan(model)
    around = {*s.before, *s.after}
    if blocks_fqn in plan and plan - {blocks_fqn} <= around:
        before = [f for f in s.before if f in plan]
        return before, [f for f in s.after if f in plan], "_pp_plan"
    rotary = [f for f in around if f.rpartition(".")[2] == "rotary_emb"]
    before = [f for f in s.before if f not in rotary]
    after = [f for f in s.after if f not in rotary]
    return before, after, "structure"


def _no_ends_reason(model: nn.Module, s: ModelStructure, blocks_fqn: str, side: str) -> str:
    """The blocks were found; what runs around them was not: meshrun reads the order the
    modules are registered in as the forward's, and ``nn.Transformer`` (and any class that
    builds its blocks first) registers them before the embedding."""
    around = [*s.before, *s.after]
    late = [f for f in s.after if isinstance(model.get_submodule(f), nn.Embedding)]
    if side == "before" and late:
        why = (
            f"{', '.join(late)} (nn.Embedding) is registered after them: meshrun takes the "
            "order in which modules are registered as the forward's order"
        )
    else:
        why = f"no module is registered {side} them, so meshrun cannot tell the embeddings/head"
    return (
        f"parallel.pp: {s.model_class}'s blocks {blocks_fqn} ({s.n_blocks} x {s.block_class}) "
        f"were found, but {why}; pass the modules around the blocks in forward order, "
        f"run.pipeline(model, loss_fn, spec=ModelSpec(before=({', '.join(map(repr, late))}"
        f"{', ' if late else ''}...), after=(...))), from those registered: "
        f"{', '.join(around) or 'none'}; or register them in forward order in __init__"
    )


def split_model(
    model: nn.Module, s: ModelStructure, n_stages: int, shared: tuple[str, ...] = ()
) -> StageSplit:
    """Every stage's parts; ``shared``: modules every stage holds (rotary embeddings)."""
    blocks_fqn = s.require_blocks("parallel.pp")
    blocks = s.block_names()
    before, after, source = _ends(model, s, blocks_fqn)
    if not before or not after:
        raise ConfigError(
            _no_ends_reason(model, s, blocks_fqn, "before" if not before else "after")
        )
    if s.split_points:
        ranges = _user_ranges(blocks, s.split_points, n_stages)
    else:
        ranges = split_blocks(len(blocks), n_stages)
    last = n_stages - 1
    parts = [
        StageParts(
            tuple(before) if i == 0 else (),
            tuple(blocks[j] for j in r),
            tuple(after) if i == last else (),
            shared,
        )
        for i, r in enumerate(ranges)
    ]
    return StageSplit(parts, source)
