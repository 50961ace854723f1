"""Traced memory: one rank's share of a layout, counted by running the user's model.

The model (built on the meta device) is laid out by meshrun's own ``parallelize`` on a fake
world (torch's ``fake`` process-group backend: every collective is a no-op, so one process
stands for rank 0 of N), allocated as ``FakeTensor``s (shapes and dtypes, no storage), and
driven through one training step (forward, backward, AdamW/SGD step) under torch's memory
trackers (``torch.distributed._tools``: ``FSDPMemTracker`` for ZeRO-2/3, ``MemTracker``
otherwise). They count every tensor the step allocates by what it is (parameters, gradients,
optimizer states, activations, all-gather and reduce-scatter buffers, temporaries) and keep the
peak. Nothing is allocated and no GPU is needed.

Identical blocks make the peak affine in their number, so a deep model is traced with a few
blocks (``TRACED_BLOCKS``) and extrapolated along the line through the two counts; a model
no deeper than that is traced whole. The optimizer's states are created before the tracked
step (a step on zero gradients), so the tracked step is a steady-state one, not the first.

Reserved memory (what ``torch.cuda.max_memory_reserved`` reports, what an OOM is about) is the
allocated peak plus the caching allocator's waste: :func:`reserved_bytes` states the model.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from meshrun.plan.errors import PlanError

if TYPE_CHECKING:
    from meshrun.parallel.trace_stages import RankPosition, StagePosition

GiB = 2**30
TRACED_BLOCKS = (2, 3)  # a deeper model is traced at these depths and extrapolated
# The caching allocator's waste at the peak, as a fraction of the allocated bytes: blocks
# split from 2 MiB-rounded segments and cached free blocks that do not fit the next request.
# 3 % is torch's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which
# torchtitan's launcher sets) and meshrun's CPU runs; docs/plan.md shows the rows it is
# checked on. Without expandable segments the waste is larger and workload-dependent.
FRAGMENTATION = 0.03
SEGMENT = 2 * 2**20  # the allocator maps memory in 2 MiB pages/segments


@dataclass(frozen=True)
class TraceLayout:
    """What one rank runs: the mesh degrees (pp: its stage of the model, holding the
    micro-batches its ``schedule`` keeps in flight of ``microbatches``: parallel/trace_stages.py),
    the ZeRO stage, the micro-batch and sequence, activation checkpointing and the precision."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch: int = 1
    seq: int = 1024
    ac: str = "none"  # none | selective | full
    precision: str = "bf16"  # bf16 | fp16 | fp32
    optimizer: str = "adamw"  # adam | adamw | sgd
    microbatches: int = 1  # the pipeline's micro-batches per step (parallel.pp_microbatches)
    schedule: str = "1f1b"  # parallel.pp_schedule
    virtual: int = 1  # stages per rank under interleaved, zb1p (parallel.pp_virtual_stages)
    # A GPU target: the optimizer's multi-tensor path (torch's default there) and the
    # communication streams' own allocator pools; False: a CPU run (no streams, per-tensor).
    gpu: bool = True

    @property
    def world(self) -> int:
        """The ranks of one pipeline stage (the fake world)."""
        return self.dp_replicate * self.dp_shard * self.tp


@dataclass
class Traced:
    """A traced peak: bytes by kind at the moment of the peak, its allocated and reserved
    totals, the depths traced and the seconds it took. Under a pipeline the figures are the
    worst stage's; ``stages`` holds each traced stage's allocated peak (first, last)."""

    parts: dict[str, float]
    allocated: float
    reserved: float
    blocks: tuple[int, ...]
    seconds: float
    stages: tuple[float, ...] = ()

    def as_gb(self) -> dict[str, float]:
        out = {k: round(v / 1e9, 3) for k, v in self.parts.items()}
        out["allocated"] = round(self.allocated / 1e9, 3)
        out["reserved"] = round(self.reserved / 1e9, 3)
        return out


def reserved_bytes(allocated: float, comm_pools: float = 0.0) -> float:
    """The allocator's reserved peak for an allocated peak: the waste :data:`FRAGMENTATION`
    on top, plus the communication streams' own pools (``comm_pools``: on a GPU FSDP2's
    all-gather and reduce-scatter buffers live on side streams, whose cached blocks the
    compute stream cannot reuse), rounded up to whole 2 MiB segments."""
    total = allocated * (1.0 + FRAGMENTATION) + comm_pools
    return math.ceil(total / SEGMENT) * SEGMENT


# --- the fake world ------------------------------------------------------------------------


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """Rank 0 of a fake world of ``world`` ranks as the default process group, for the
    duration. Refused when a real process group exists (a worker forks first: fit.py)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group exists: trace in a fresh process (train/fit.py)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


# --- one traced step -----------------------------------------------------------------------


def trace(model: nn.Module, lay: TraceLayout) -> Traced:
    """The peak of one training step of ``model`` (on the meta device; not changed) laid out
    as ``lay``, traced on one rank of a fake world."""
    from meshrun.parallel.trace_ops import rank_positions
    from meshrun.parallel.trace_stages import traced_positions

    start = time.perf_counter()
    n, m = _block_count(model), lay.microbatches
    positions: list[Any] = traced_positions(n, lay.pp, m, lay.schedule)
    if lay.pp > 1 and lay.zero < 2:  # under FSDP2 a rank's stages are traced as one 1F1B stage
        positions = rank_positions(n, lay.schedule, lay.pp, lay.virtual, m) or positions
    hidden: list[Any] = []  # what the first stage sends: the last stage's receive buffers
    stages = [_trace_stage(model, lay, pos, hidden) for pos in positions]
    parts = max(stages, key=lambda p: sum(p.values()) - p["comm_pools"])
    pools = parts.pop("comm_pools") * (1.0 if lay.gpu else 0.0)  # no streams on a CPU
    allocated = sum(parts.values())
    per_stage = tuple(sum(v for k, v in p.items() if k != "comm_pools") for p in stages)
    seconds = time.perf_counter() - start
    reserved = reserved_bytes(allocated, pools)
    return Traced(parts, allocated, reserved, _depths(positions[0].blocks), seconds, per_stage)


def _depths(blocks: int) -> tuple[int, ...]:
    return (blocks,) if blocks <= TRACED_BLOCKS[-1] else TRACED_BLOCKS


def _trace_stage(
    model: nn.Module, lay: TraceLayout, pos: StagePosition | RankPosition, hidden: list[Any]
) -> dict[str, float]:
    """One stage's (an interleaved rank's) peak by kind (comm_pools among them), extrapolated to its blocks."""
    depths = _depths(pos.blocks)
    peaks = [_trace_at(model, lay, d, pos, hidden) for d in depths]
    return peaks[0] if len(peaks) == 1 else _extrapolate(peaks, depths, pos.blocks)


def _extrapolate(
    peaks: list[dict[str, float]], depths: tuple[int, ...], blocks: int
) -> dict[str, float]:
    (a, b), (da, db) = peaks[:2], depths[:2]
    return {k: a[k] + (b[k] - a[k]) * (blocks - da) / (db - da) for k in a}


def _trace_at(
    model: nn.Module,
    lay: TraceLayout,
    depth: int,
    pos: StagePosition | RankPosition,
    hidden: list[Any],
) -> dict[str, float]:
    """One traced step of the stage at ``pos`` with ``depth`` blocks (all of them when
    ``depth`` is the stage's own count)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from meshrun.parallel.trace_stages import RankPosition, stage_module

    vocab = _vocab(model)
    if isinstance(pos, RankPosition):  # a rank's stages (trace_ops.py), each cut to depth
        stages = [stage_module(_stage_of(model, min(depth, p.blocks)), p) for p in pos.stages]
        with fake_world(lay.world):
            mesh = _mesh(lay)
            with FakeTensorMode(allow_non_fake_inputs=True):
                return _traced_rank(stages, mesh, vocab, lay, pos, hidden)
    copy_ = _stage_of(model, depth)
    stage = stage_module(copy_, pos) if lay.pp > 1 else copy_
    with fake_world(lay.world):
        mesh = _mesh(lay)  # a real (CPU) tensor of ranks: built outside the fake mode
        with FakeTensorMode(allow_non_fake_inputs=True):
            return _traced_stage(stage, mesh, vocab, lay, pos, hidden)


def _traced_rank(
    stages: list[nn.Module],
    mesh: Any,
    vocab: int,
    lay: TraceLayout,
    pos: RankPosition,
    hidden: list[Any],
) -> dict[str, float]:
    """One interleaved rank's step: its stages laid out one by one (as parallelize_stage
    does), one optimizer over them, the schedule's ops in torch's order."""
    from meshrun.parallel.trace_ops import run_rank_ops
    from meshrun.parallel.trace_stages import output_meta, stage_io

    laid = nn.ModuleList(_lay_out(s, mesh, lay) for s in stages)
    optimizer = _optimizer(laid, lay)
    tokens = torch.randint(0, vocab, (lay.micro_batch, lay.seq))
    if not hidden:  # the first rank, traced first, holds the first stage
        hidden.append(output_meta(laid[0], tokens))
    ios = [stage_io(p, tokens, hidden[0]) for p in pos.stages]
    tensors = [t for io in ios for t in io.tensors()]
    parts = _tracked_step(
        laid, optimizer, tensors, lambda: run_rank_ops(list(laid), pos, ios, output_loss)
    )
    if lay.zero < 2 and lay.dp_replicate * lay.dp_shard > 1:
        parts["grads"] = _ddp_buckets(laid)
    return parts


def _traced_stage(
    stage: nn.Module,
    mesh: Any,
    vocab: int,
    lay: TraceLayout,
    pos: StagePosition,
    hidden: list[Any],
) -> dict[str, float]:
    from meshrun.parallel.trace_stages import output_meta, run_schedule, stage_io

    laid = _lay_out(stage, mesh, lay)
    optimizer = _optimizer(laid, lay)
    tokens = torch.randint(0, vocab, (lay.micro_batch, lay.seq))
    if lay.pp > 1 and not hidden:  # the first stage, traced first
        hidden.append(output_meta(laid, tokens))
    io = stage_io(pos, tokens, hidden[0] if hidden else ((), torch.float32))
    parts = _tracked_step(
        laid, optimizer, io.tensors(), lambda: run_schedule(laid, pos, io, output_loss)
    )
    if lay.zero < 2 and lay.dp_replicate * lay.dp_shard > 1:
        parts["grads"] = _ddp_buckets(laid)
    return parts


def _ddp_buckets(model: nn.Module) -> float:
    """DDP keeps every gradient in its buckets (``gradient_as_bucket_view``, meshrun's
    default) for the whole step: the gradients' bytes are resident at any peak."""
    from meshrun.parallel.report import local_param_bytes

    return float(local_param_bytes(model)[0])


def _stage_of(model: nn.Module, depth: int) -> nn.Module:
    """A copy of ``model`` (meta: nothing allocated) keeping its first ``depth`` blocks (a
    pipeline stage is cut from it: parallel/trace_stages.py)."""
    from meshrun.parallel.structure import find_structure

    structure = find_structure(model)
    if structure.blocks_fqn is None:
        return _without_init(copy.deepcopy(model))
    keep = depth
    container = model.get_submodule(structure.blocks_fqn)
    dropped = [(k, container._modules[k]) for k in structure.block_keys[keep:]]
    for k, _ in dropped:  # deep-copied without the dropped blocks, then put back
        del container._modules[k]
    try:
        return _without_init(copy.deepcopy(model))
    finally:
        container._modules.update(dropped)
        _reorder(container, structure.block_keys)


def _without_init(model: nn.Module) -> nn.Module:
    """Fake tensors hold no values: the copy's initialisation (which parallelize calls after
    allocating a meta model) is a no-op, so a model without ``init_weights`` traces too."""
    model.init_weights = _no_init  # type: ignore[assignment]
    return model


def _no_init() -> None:
    return None


def _reorder(container: nn.Module, keys: tuple[str, ...]) -> None:
    modules = container._modules
    ordered = {k: modules[k] for k in keys} | {k: v for k, v in modules.items() if k not in keys}
    modules.clear()
    modules.update(ordered)


def _block_count(model: nn.Module) -> int:
    from meshrun.parallel.structure import find_structure

    return find_structure(model).n_blocks


def _vocab(model: nn.Module) -> int:
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise PlanError(
            f"the trace feeds token ids, and {type(model).__name__} has no nn.Embedding to "
            "take them; plan it by its shape (--layers --hidden ...) instead"
        )
    return int(embedding.num_embeddings)


def _mesh(lay: TraceLayout) -> Any:
    from meshrun.runtime.mesh import ParallelDims, build_mesh

    # DDP's constructor broadcasts real storage (fake tensors have none): ZeRO-0/1 traces
    # the tensor-parallel part alone and adds DDP's buckets (_ddp_buckets).
    dp = (lay.dp_replicate, lay.dp_shard) if lay.zero >= 2 else (1, 1)
    dims = ParallelDims(1, *dp, lay.tp)
    return build_mesh(dims, "cpu") if dims.world_size > 1 else None


def _lay_out(model: nn.Module, mesh: Any, lay: TraceLayout) -> nn.Module:
    """meshrun's own parallelize on the fake mesh: what the run would build."""
    from meshrun.config import ParallelConfig
    from meshrun.parallel import parallelize

    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[lay.precision]
    ddp = lay.zero < 2
    cfg = ParallelConfig(
        dp_replicate=1 if ddp else lay.dp_replicate,
        dp_shard=1 if ddp else lay.dp_shard,
        tp=lay.tp,
        zero=lay.zero,
        activation_checkpoint=0 if lay.ac == "none" else 1,
        param_dtype=dtype,  # type: ignore[arg-type]
    )
    laid = parallelize(model, mesh, cfg, torch.device("cpu"))
    if lay.ac == "selective":
        from meshrun.parallel.ac import apply_selective

        apply_selective(laid)
    return laid


def _optimizer(model: nn.Module, lay: TraceLayout) -> torch.optim.Optimizer:
    """The optimizer with its states created (a step on zero gradients), untracked. Under
    ZeRO-1 it holds this rank's share: parameters in order up to 1/dp of the bytes, as
    ZeroRedundancyOptimizer's greedy partition about does."""
    params = [p for p in model.parameters() if p.requires_grad]
    dp = lay.dp_replicate * lay.dp_shard
    if lay.zero == 1 and dp > 1:
        params = _share(params, dp)
    opt: torch.optim.Optimizer
    if lay.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=lay.gpu)
    else:
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=lay.gpu)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def _share(params: list[nn.Parameter], dp: int) -> list[nn.Parameter]:
    budget = sum(p.numel() for p in params) / dp
    out: list[nn.Parameter] = []
    held = 0
    for p in sorted(params, key=lambda q: q.numel()):
        if held + p.numel() > budget and out:
            break
        out.append(p)
        held += p.numel()
    return out


def _tracked_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    inputs: list[torch.Tensor],
    run: Callable[[], None],
) -> dict[str, float]:
    """One step of the stage under torch's tracker: ``run`` (its schedule's forwards and
    backwards; one forward and backward without a pipeline), then the optimizer's."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from meshrun.parallel.trace_stages import repeat_tolerant

    tracker: Any
    if isinstance(model, FSDPModule):
        tracker = repeat_tolerant(FSDPMemTracker)(model, opt)
        tracker.track_inputs(tuple(inputs))
    else:
        tracker = repeat_tolerant(MemTracker)()
        tracker.track_external(model, opt, *inputs)
    inputs.clear()  # held by the stages' StageIO only: a V's turn replaces buffers, as torch's
    with tracker:
        run()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = tracker.get_tracker_snapshot("peak")
    parts = _by_kind(next(iter(peak.values())) if peak else {})
    parts["comm_pools"] = _comm_pools(tracker)
    return parts


def _comm_pools(tracker: Any) -> float:
    """The most FSDP2's all-gather and reduce-scatter buffers held at any snapshot: on a GPU
    they are allocated on their own CUDA streams, whose caching-allocator pools are not shared
    with the compute stream's, so their peaks add to its peak in reserved memory."""
    most = {"all gather": 0.0, "reduce scatter": 0.0}
    for stats in getattr(tracker, "memory_tracking", {}).values():
        for snaps in stats.snapshots.values():
            for snap in snaps:
                for per_device in snap.values():
                    for k, v in per_device.items():
                        name = getattr(k, "value", str(k)).lower()
                        if name in most:
                            most[name] = max(most[name], float(v))
    return sum(most.values())


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """A language model's loss: next-token cross entropy on float32 logits (as the demo and
    torchtitan compute it); any other output: the sum of its first tensor."""
    return output_loss(model(tokens), tokens)


def output_loss(out: Any, tokens: torch.Tensor) -> torch.Tensor:
    """:func:`_loss` on a model's output (a last pipeline stage's: parallel/trace_stages.py)."""
    logits = getattr(out, "logits", None)
    if logits is None:
        logits = out[0] if isinstance(out, (tuple, list)) else out
    del out
    if logits.dim() == 3:
        flat = logits.flatten(0, 1).float()
        return nn.functional.cross_entropy(flat, tokens.flatten() % logits.shape[-1])
    return logits.float().sum()


KINDS = {
    "params": ("parameter", "sharded param", "unsharded param"),
    "grads": ("gradient", "sharded grad", "unsharded grad"),
    "optimizer": ("optstate",),
    "activations": ("activation", "inputs", "other"),
    "buffers": ("buffer", "all gather", "reduce scatter"),
    "temporaries": ("temp",),
}


def _by_kind(snapshot: dict[Any, int]) -> dict[str, float]:
    """The tracker's reference types folded into the planner's six kinds."""
    values = {getattr(k, "value", str(k)).lower(): float(v) for k, v in snapshot.items()}
    return {kind: sum(values.get(n, 0.0) for n in names) for kind, names in KINDS.items()}


__all__ = ["FRAGMENTATION", "TraceLayout", "Traced", "reserved_bytes", "trace"]
