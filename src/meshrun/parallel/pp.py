"""Pipeline parallel with ``torch.distributed.pipelining``: split at block boundaries, one or
more stages per rank, GPipe / 1F1B / interleaved 1F1B schedules.

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

Stages are built for GPT-2 shaped models (``tok_emb``, ``pos_emb``, ``drop``, a ``blocks``
ModuleList, ``norm``, ``lm_head``, like ``meshrun.demo.model.GPT``); the stage modules keep the
original parameter names (``blocks.3.attn.q.weight``), so checkpoints stay comparable.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from meshrun.config import ConfigError, ParallelConfig

if TYPE_CHECKING:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

GPT_PARTS = ("tok_emb", "pos_emb", "drop", "blocks", "norm", "lm_head")
LossFn = Callable[[Tensor, Tensor], Tensor]


class StageModule(nn.Module):
    """The blocks ``first_block .. first_block + len(blocks)`` of a GPT-shaped model, with the
    embeddings on the first stage and the final norm and head on the last."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        part = model.get_submodule  # typed access to the GPT parts (checked by the caller)
        self.tok_emb = part("tok_emb") if first else None
        self.pos_emb = part("pos_emb") if first else None
        self.drop = part("drop") if first else None
        self.blocks = nn.ModuleDict({str(i): part(f"blocks.{i}") for i in blocks})
        self.norm = part("norm") if last else None
        self.lm_head = part("lm_head") if last else None

    def forward(self, x: Tensor) -> Tensor:
        if self.tok_emb is not None and self.pos_emb is not None and self.drop is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = block(x)
        if self.norm is not None and self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


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


def stages_per_rank(cfg: ParallelConfig) -> int:
    return cfg.pp_virtual_stages if cfg.pp_schedule == "interleaved" else 1


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
        return t.to_local() if isinstance(t, DTensor) else t


def _alias(p: nn.Parameter) -> nn.Parameter:
    if isinstance(p, DTensor) and not all(pl.is_replicate() for pl in p.placements):
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


def build_stage_modules(
    model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig
) -> list[StageModule]:
    """This rank's stages: with v stages per rank, rank r holds stages r, r + pp, ... (looped)."""
    missing = [p for p in GPT_PARTS if not hasattr(model, p)]
    if missing:
        raise ConfigError(
            f"parallel.pp = {cfg.pp}: meshrun splits GPT-shaped models ({', '.join(GPT_PARTS)}); "
            f"{type(model).__name__} has no {', '.join(missing)}"
        )
    pp, v = cfg.pp, stages_per_rank(cfg)
    ranges = split_blocks(len(model.blocks), pp * v)  # type: ignore[arg-type]
    me = mesh["pp"].get_local_rank()
    ids = [me + k * pp for k in range(v)]
    return [StageModule(model, ranges[i], i == 0, i == pp * v - 1) for i in ids]


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
    pp_mesh, v = mesh["pp"], stages_per_rank(cfg)
    group, me = pp_mesh.get_group(), pp_mesh.get_local_rank()
    n = cfg.pp * v
    ids = [me + k * cfg.pp for k in range(v)]
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

    stages = [
        PipelineStage(m, i, n, device, group=group) for m, i in zip(modules, ids, strict=True)
    ]
    if cfg.pp_schedule == "interleaved":
        schedule: PipelineScheduleSingle | PipelineScheduleMulti = ScheduleInterleaved1F1B(
            cast("list[Any]", stages), chunks, loss_fn=chunk_loss, scale_grads=False
        )
    else:
        cls = ScheduleGPipe if cfg.pp_schedule == "gpipe" else Schedule1F1B
        schedule = cls(stages[0], chunks, loss_fn=chunk_loss, scale_grads=False)
    last_local = (n - 1) % cfg.pp
    last_rank = dist.get_global_rank(group, last_local)
    is_last = n - 1 in ids
    lp = cfg.loss_parallel and is_last
    return Pipeline(modules, schedule, 0 in ids, is_last, group, last_rank, scaler, lp)


def pipeline_step(pipe: Pipeline, inputs: Tensor, targets: Tensor) -> Tensor:
    """Forward and backward of one micro-batch through the pipeline; returns the mean loss on
    every rank of the pipeline (see the module docstring)."""
    losses: list[Tensor] = []
    kwargs: dict[str, Any] = {"target": targets, "losses": losses} if pipe.is_last else {}
    args = (inputs,) if pipe.is_first else ()
    _views_before_step(pipe)
    # Loss parallel: the schedule computes the loss on the vocab-sharded logits and runs its
    # backward inside step(), so the whole step runs in the context (it only changes DTensor
    # log-softmax / nll-loss, which nothing but the loss uses).
    with loss_parallel() if pipe.loss_parallel else nullcontext():
        pipe.schedule.step(*args, **kwargs)
    _views_after_step(pipe)
    # The chunks' losses carry 1/chunks already: their sum is the mean over the micro-batch.
    loss = (
        torch.stack([_full(x) for x in losses]).sum().float() if pipe.is_last else torch.zeros(())
    )
    if pipe.scaler is not None and pipe.is_last:
        loss = loss / pipe.scaler.get_scale()  # a power of two: the division is exact
    dist.broadcast(loss, src=pipe.last_rank, group=pipe.group)
    return loss


def _full(loss: Tensor) -> Tensor:
    """A chunk's loss as a plain tensor (under loss parallel a replicated DTensor)."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
