"""Pipeline parallel with ``torch.distributed.pipelining``: split at block boundaries, one or
more stages per rank, torch's schedules: GPipe, 1F1B, interleaved 1F1B and the zero-bubble
ZB1P, ZB-V and DualPipeV (stage placement per schedule: parallel/pp/placement.py).

The loop change is explicit: a pipelined model is not called by the user. Each optimizer step,
every rank calls :func:`pipeline_step` with the whole micro-batch (the first stage's ranks use
the inputs, the last stage's ranks the targets); the schedule splits it into
``pp_microbatches`` chunks, runs forward and backward through the stages with each chunk's
loss divided by the number of chunks, so the gradients equal those of one pass over the
micro-batch and accumulate across micro-steps like ``run.backward``'s. The returned loss
is the mean over the chunks, broadcast from the last stage to every rank of the pipeline.
Under fp16 each chunk's loss is multiplied by the loss scaler's scale inside the schedule
(the schedule runs the backward, so that is the only place the scaling can happen); the
returned loss is the unscaled one.

Each stage module is parallelized on the non-pp sub-mesh before the schedule is built
(torchtitan's ``pipeline_llama`` + ``parallelize`` flow): tensor parallel over ``tp``, FSDP2
or ``replicate`` over the dp dims. ``PipelineStage`` knows both (FSDPModules): it runs the
chunks' backwards without gradient sync and reduces once, after the last chunk.

ZeRO-1 (``zero = 1``): the stages are replicated as for DDP, and the ZeroRedundancyOptimizer
steps plain aliases of their DTensor parameters (:meth:`Pipeline.local_parameters`), which
``pipeline_step`` keeps in step. Loss parallel: only the last stage holds the head, and its
``schedule.step`` (which computes the loss and runs the backward) runs in ``loss_parallel()``.

Stages are built from the model's structure (parallel/structure.py: its blocks, what runs
before and after them; a Hugging Face model's ``_pp_plan``; parallel/pp/split.py) for any model
whose structure is known: the demo GPT, nanoGPT, Hugging Face causal LMs (Llama, Qwen2, GPT-2,
...), or the user's ``ModelSpec``. Stage modules keep the model's own FQNs
(``model.layers.3.mlp.up_proj.weight``), so checkpoints, TP plans and FSDP units stay those of
the unsplit model; every stage is checked against the model's own forward before training
(parallel/pp/stages.py). Tied parameters that span two stages (nanoGPT's and GPT-2's
``lm_head`` = ``wte``) are kept tied (parallel/pp/tied.py). :func:`pipeline_eval` is the
forward-only call for evaluation.

A model built on the meta device is split as it is; each rank allocates and initialises only
its own stages, after their layout (parallel/pp/meta.py), and the check against the model's
forward compares shapes only (a meta model has no values). The stages keep a transformers
model's class and configs (not the model), so a pipeline checkpoint saves its ``config.json``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun.config import ConfigError, ParallelConfig
from meshrun.parallel.kinds import is_dtensor as _is_dtensor
from meshrun.parallel.pp.forward_only import forward_only
from meshrun.parallel.pp.meta import StageInit, materialize_stages, stage_initializer
from meshrun.parallel.pp.placement import V_SHAPED, rank_of_stage, stage_ids, stages_per_rank
from meshrun.parallel.pp.split import split_blocks, split_model
from meshrun.parallel.pp.stages import StageModule, check_stages_reproduce, hf_context
from meshrun.parallel.pp.tied import (
    TiedCopy,
    TiedPair,
    plan_tied,
    stash_tied_grads,
    sync_tied_grads,
)
from meshrun.parallel.precision import compute_autocast
from meshrun.parallel.structure import ModelSpec, ModelStructure, find_structure, is_hf_model

# torch.distributed.pipelining and DTensor are imported where a pipeline first needs them: a
# run without one (plain DDP) starts without paying for their imports (about 1.5 s of CPU).
if TYPE_CHECKING:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
    )

__all__ = [
    "Pipeline",
    "Stages",
    "build_pipeline",
    "build_stage_modules",
    "pipeline_eval",
    "pipeline_step",
    "split_blocks",
]

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class Pipeline:
    """This rank's stage modules (StageModules, changed in place by TP / FSDP2 / replicate)
    and the schedule that drives them."""

    modules: list[nn.Module]
    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    is_first: bool
    is_last: bool
    group: dist.ProcessGroup
    last_rank: int  # global rank of the last stage in this rank's pipeline
    scaler: ShardedGradScaler | None = None  # fp16: scales each chunk's loss (see build_pipeline)
    loss_parallel: bool = False  # the last stage's loss runs inside loss_parallel()
    # (stage parameter, plain alias of its local data): see local_parameters
    local_views: list[tuple[nn.Parameter, nn.Parameter]] = field(default_factory=list)
    # This rank's copies of tied parameters that span two stages (parallel/pp/tied.py).
    tied: list[TiedCopy] = field(default_factory=list)
    loss_fn: LossFn | None = None  # the loss the schedule computes, unscaled (pipeline_eval)
    chunks: int = 1  # the schedule's micro-batches per call (parallel.pp_microbatches)
    v_shaped: bool = False  # ZB-V / DualPipeV: eval runs their forwards only (forward_only.py)
    # (rows, *other dims) of every eval forward, fixed by the first eval batch (pipeline_eval)
    eval_shape: tuple[int, ...] | None = None

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (all its stages), for the optimizer."""
        return [p for m in self.modules for p in m.parameters()]

    def local_parameters(self) -> list[nn.Parameter]:
        """Plain-tensor parameters sharing storage with this rank's stage parameters, for an
        optimizer that cannot take DTensors (ZeRO-1's ZeroRedundancyOptimizer broadcasts each
        updated parameter with a plain c10d broadcast). Under ``replicate`` each DTensor's
        local tensor is the whole parameter, so stepping the alias steps the parameter.

        :func:`pipeline_step` keeps the pairs in step: after the schedule each alias's
        ``.grad`` is the (already all-reduced) local gradient, and an alias whose gradient
        the optimizer set to None clears its parameter's before the next backward (else
        FSDP2's reduce would accumulate into the stale gradient)."""
        if not self.local_views:
            self.local_views = [(p, _alias(p)) for p in self.parameters() if p.requires_grad]
        return [alias for _, alias in self.local_views]


def _local(t: Tensor) -> Tensor:
    with torch.no_grad():  # without grad mode to_local() returns the local tensor itself
        return t.to_local() if _is_dtensor(t) else t


def _alias(p: nn.Parameter) -> nn.Parameter:
    if _is_dtensor(p) and not all(pl.is_replicate() for pl in p.placements):
        raise ConfigError(
            f"Pipeline.local_parameters: a stage parameter is split ({p.placements}), so its "
            "local tensor is not the whole parameter; it needs replicated stages (parallel.zero"
            " 0 or 1 without tp), or use pipe.parameters()"
        )
    alias = nn.Parameter(_local(p), requires_grad=p.requires_grad)  # shares the storage
    alias.meshrun_view_of = p  # type: ignore[attr-defined]  # checkpoints name it by p's FQN
    return alias


def _views_before_step(pipe: Pipeline) -> None:
    for p, alias in pipe.local_views:
        if alias.grad is None:
            p.grad = None  # optimizer.zero_grad(set_to_none=True) went through the alias
        alias.data = _local(p)  # the same storage, unless a load replaced the tensor


def _views_after_step(pipe: Pipeline) -> None:
    for p, alias in pipe.local_views:
        alias.grad = None if p.grad is None else _local(p.grad)


@dataclass
class Stages:
    """This rank's stage modules (before parallelization), their indices in the pipeline, the
    tied pairs that span two stages, and the start-up line that says how the model was split."""

    modules: list[StageModule]
    ids: list[int]
    tied: list[TiedPair]
    describe: str
    structure: ModelStructure  # the whole model's (TP plans name the model's FQNs)
    init: StageInit | None = None  # the model was on the meta device: its initialiser

    def materialize(self, modules: Sequence[nn.Module], device: torch.device) -> None:
        """A meta model's stages, once parallelized: allocated and initialised
        (parallel/pp/meta.py); nothing for a model built on a real device."""
        if self.init is not None:
            materialize_stages(modules, device, self.init)

    def structure_of(self, stage: StageModule) -> ModelStructure:
        """The model's structure as one stage sees it: tied pairs only where the stage holds
        both names (pairs across stages are kept tied by parallel/pp/tied.py)."""
        held = set(stage.state_dict(keep_vars=True))
        inside = tuple(t for t in self.structure.tied if set(t) <= held)
        return dataclasses.replace(self.structure, tied=inside)


def build_stage_modules(
    model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, spec: ModelSpec | None = None
) -> Stages:
    """This rank's stages (parallel/pp/placement.py: one, looped or V-shaped). Every stage is
    built on every rank (they only reference the model's modules) so that all of them are
    checked, in a row, against the model's own forward before any training."""
    structure = find_structure(model, spec)
    meta = any(p.is_meta for p in model.parameters())
    init = stage_initializer(model) if meta else None  # refused before anything changes
    pp, v = cfg.pp, stages_per_rank(cfg)
    blocks = structure.block_names() if structure.blocks_fqn else []
    block_kwargs, shared = (
        hf_context(model, blocks) if is_hf_model(model) and blocks else (None, ())
    )
    split = split_model(model, structure, pp * v, shared)
    every = [StageModule(model, parts, block_kwargs) for parts in split.parts]
    # a meta model's check runs on fake CPU tensors, in the precision the stages compute in
    checked = check_stages_reproduce(model, every, compute_autocast(cfg, "cpu"))
    source = _hf_source(model)
    for stage in every:  # what a checkpoint saves as config.json (checkpoint/hf_files.py)
        stage.meshrun_hf_source = source
    tied = plan_tied(structure.tied, split.parts, lambda s: rank_of_stage(s, cfg))
    ids = stage_ids(mesh["pp"].get_local_rank(), cfg)
    names = ", ".join(
        " = ".join(t.fqns) + f" (stages {t.stages[0]} and {t.stages[1]})" for t in tied
    )
    line = (
        f"pipeline split: {split.describe()} | tied across stages: {names or 'none'} | "
        f"checked against the model's forward: {checked}"
    )
    return Stages([every[i] for i in ids], ids, tied, line, structure, init)


@dataclass(frozen=True)
class HFSource:
    """A transformers model's class and configs, kept by its stages after the split (never
    the model: its other stages' weights would stay alive), so that a pipeline checkpoint
    saves ``config.json`` as a whole model's does."""

    model_class: type
    config: Any
    generation_config: Any


def _hf_source(model: nn.Module) -> HFSource | None:
    config = getattr(model, "config", None)
    if not callable(getattr(config, "to_json_string", None)):
        return None
    return HFSource(type(model), config, getattr(model, "generation_config", None))


def build_pipeline(
    modules: list[nn.Module],
    mesh: DeviceMesh,
    cfg: ParallelConfig,
    loss_fn: LossFn,
    device: torch.device,
    scaler: ShardedGradScaler | None = None,
) -> Pipeline:
    """Wrap the (already parallelized) stage modules in PipelineStages and a schedule; under
    fp16 ``scaler`` scales each chunk's loss before the schedule's backward."""
    if cfg.pp_microbatches < cfg.pp:
        raise ConfigError(
            f"parallel.pp_microbatches = {cfg.pp_microbatches} is fewer than parallel.pp = "
            f"{cfg.pp} stages: the pipeline would idle; set pp_microbatches >= {cfg.pp}"
        )
    pp_mesh = mesh["pp"]
    group = pp_mesh.get_group()
    n = cfg.pp * stages_per_rank(cfg)
    ids = stage_ids(pp_mesh.get_local_rank(), cfg)
    chunks = cfg.pp_microbatches

    if scaler is not None:
        # The scale is created lazily by the first scale(); ranks without the last stage never
        # call it in the schedule, yet their unscale_/step/update need it.
        scaler.scale(torch.zeros((), device=device))

    def chunk_loss(output: Tensor, target: Tensor) -> Tensor:
        # 1/chunks here, not the schedule's scale_grads: that divides the whole .grad after the
        # step, so it would also divide what earlier accumulation micro-steps left there.
        loss = loss_fn(output, target) / chunks
        return loss if scaler is None else scaler.scale(loss)

    from torch.distributed.pipelining import PipelineStage

    stages = [
        PipelineStage(m, i, n, device, group=group) for m, i in zip(modules, ids, strict=True)
    ]
    schedule = _schedule(cfg, stages, chunks, chunk_loss)
    _check_placement(schedule, n, cfg)
    last_local = rank_of_stage(n - 1, cfg)
    last_rank = dist.get_global_rank(group, last_local)
    is_last = n - 1 in ids
    lp = cfg.loss_parallel and is_last
    pipe = Pipeline(modules, schedule, 0 in ids, is_last, group, last_rank, scaler, lp)
    pipe.loss_fn, pipe.chunks = loss_fn, chunks
    pipe.v_shaped = cfg.pp_schedule in V_SHAPED
    return pipe


def pipeline_step(pipe: Pipeline, inputs: Tensor, targets: Tensor) -> Tensor:
    """Forward and backward of one micro-batch through the pipeline; returns the mean loss on
    every rank of the pipeline (see the module docstring)."""
    losses: list[Tensor] = []
    kwargs: dict[str, Any] = {"target": targets, "losses": losses} if pipe.is_last else {}
    args = (inputs,) if pipe.is_first else ()
    _views_before_step(pipe)
    saved = stash_tied_grads(pipe.tied)
    # Loss parallel: the schedule computes the loss on the vocab-sharded logits and runs its
    # backward inside step(), so the whole step runs in the context (it only changes DTensor
    # log-softmax / nll-loss, which nothing but the loss uses).
    # return_outputs=False: the loss is all this step uses, and torch's last stage would
    # otherwise keep every chunk's logits alive until the step ends (m x chunk x seq x vocab).
    with _loss_parallel(pipe):
        pipe.schedule.step(*args, return_outputs=False, **kwargs)
    sync_tied_grads(pipe.tied, saved)  # before the aliases read the gradients
    _views_after_step(pipe)
    # The chunks' losses carry 1/chunks already: their sum is the mean over the micro-batch.
    loss = (
        torch.stack([_full(x) for x in losses]).sum().float() if pipe.is_last else torch.zeros(())
    )
    if pipe.scaler is not None and pipe.is_last:
        loss = loss / pipe.scaler.get_scale()  # a power of two: the division is exact
    dist.broadcast(loss, src=pipe.last_rank, group=pipe.group)
    return loss


def pipeline_eval(pipe: Pipeline, inputs: Tensor, targets: Tensor) -> Tensor:
    """Forward only (evaluation): the batch's mean loss, ``pipe.loss_fn`` on the last stage's
    logits of exactly these rows, on every rank of the pipeline (one process's loss over the
    same examples). No gradients, no change to any state; call it with the stage modules in
    eval mode (``for m in pipe.modules: m.eval()``) as one would call ``model.eval()``.

    Any number of rows, the same on every rank of the pipeline. The schedule's stages fix
    their receive buffers' shapes at the first forward of a mode (train or eval), so every
    eval forward runs on one shape: the first eval batch's rows rounded up to a multiple of
    the schedule's chunks. A smaller batch (the last of an eval set) is padded to it with
    copies of its own rows, a larger one runs as several such pieces, and the loss is
    computed once, on the real rows' logits only: the padding costs the forward of the
    padded rows and changes nothing. Later batches must keep the first one's other dims.

    The schedule's ``eval`` runs the chunks forward only (torch.distributed.pipelining); it
    takes the targets because it computes its chunk losses (with the training scale), so the
    loss returned here is recomputed from the merged logits instead."""
    if pipe.loss_fn is None:
        raise ValueError("pipeline_eval: this Pipeline was built without a loss_fn")
    rows, n = _eval_rows(pipe, inputs), int(inputs.shape[0])
    with torch.no_grad(), _loss_parallel(pipe):
        pieces = [
            _eval_piece(pipe, inputs[i : i + rows], targets[i : i + rows], rows)
            for i in range(0, n, rows)
        ]
        loss = None
        if pipe.is_last:
            logits = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # n rows
            loss = _full(pipe.loss_fn(logits, targets)).float()
    out = loss if loss is not None else torch.zeros(())
    dist.broadcast(out, src=pipe.last_rank, group=pipe.group)
    return out


def _eval_rows(pipe: Pipeline, inputs: Tensor) -> int:
    """The rows of every eval forward: fixed by the first eval batch (see pipeline_eval)."""
    if pipe.eval_shape is None:
        rows = -(-int(inputs.shape[0]) // pipe.chunks) * pipe.chunks
        pipe.eval_shape = (rows, *inputs.shape[1:])
    rows, *rest = pipe.eval_shape
    if tuple(inputs.shape[1:]) != tuple(rest):
        raise ValueError(
            f"pipeline_eval: a batch of shape {tuple(inputs.shape)}, but this pipeline "
            f"evaluates batches of shape (rows, {', '.join(map(str, rest))}) (its first eval "
            "batch's): its stages' buffers keep that shape; give every eval batch the same "
            "dims after the first (e.g. the same sequence length)"
        )
    return rows


def _eval_piece(pipe: Pipeline, inputs: Tensor, targets: Tensor, rows: int) -> Tensor:
    """The last stage's logits for ``inputs`` (at most ``rows``), run padded to ``rows``."""
    n = int(inputs.shape[0])
    if n < rows:  # copies of the batch's own rows: valid inputs and targets for any model
        pick = torch.arange(rows, device=inputs.device) % n
        inputs, targets = inputs[pick], targets[pick.to(targets.device)]
    args = (inputs,) if pipe.is_first else ()
    with forward_only(pipe.schedule) if pipe.v_shaped else nullcontext():
        logits = pipe.schedule.eval(*args, target=targets if pipe.is_last else None)
    return logits[:n] if pipe.is_last else logits


def _full(loss: Tensor) -> Tensor:
    """A chunk's loss as a plain tensor (under loss parallel a replicated DTensor)."""
    loss = loss.detach()
    return loss.full_tensor() if _is_dtensor(loss) else loss


# parallel.pp_schedule -> torch's class (torch.distributed.pipelining.schedules). The
# zero-bubble ones split each backward into input (B) and weight (W) gradients and run W in
# what would be bubbles (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"); torch builds
# the split from the stage's autograd graph, so any module trains under them.
_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb1p": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def _schedule(
    cfg: ParallelConfig,
    stages: list[PipelineStage],
    chunks: int,
    chunk_loss: Callable[[Tensor, Tensor], Tensor],
) -> PipelineScheduleSingle | PipelineScheduleMulti:
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, _SCHEDULES[cfg.pp_schedule])
    if issubclass(cls, schedules.PipelineScheduleSingle):
        return cast(
            "PipelineScheduleSingle",
            cls(stages[0], chunks, loss_fn=chunk_loss, scale_grads=False),
        )
    return cast(
        "PipelineScheduleMulti",
        cls(cast("list[Any]", stages), chunks, loss_fn=chunk_loss, scale_grads=False),
    )


def _check_placement(
    schedule: PipelineScheduleSingle | PipelineScheduleMulti, n: int, cfg: ParallelConfig
) -> None:
    """The schedule's own stage -> rank map is the one the stages were placed by: a schedule
    that expects another placement would send activations to the wrong rank."""
    theirs = getattr(schedule, "stage_index_to_group_rank", None)
    if theirs is None:  # single-stage schedules: stage i on rank i
        return
    ours = {s: rank_of_stage(s, cfg) for s in range(n)}
    if dict(theirs) != ours:
        raise RuntimeError(
            f"parallel.pp_schedule = {cfg.pp_schedule}: torch's schedule places the stages "
            f"{dict(theirs)}, meshrun placed them {ours} (parallel/pp/placement.py)"
        )


def _loss_parallel(pipe: Pipeline) -> AbstractContextManager[None]:
    if not pipe.loss_parallel:
        return nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
