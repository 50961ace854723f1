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

Stages are built for GPT-2 shaped models (``tok_emb``, ``pos_emb``, ``drop``, a ``blocks``
ModuleList, ``norm``, ``lm_head``, like ``meshrun.demo.model.GPT``); the stage modules keep the
original parameter names (``blocks.3.attn.q.weight``), so checkpoints stay comparable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (all its stages), for the optimizer."""
        return [p for m in self.modules for p in m.parameters()]


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
    return Pipeline(modules, schedule, 0 in ids, n - 1 in ids, group, last_rank, scaler)


def pipeline_step(pipe: Pipeline, inputs: Tensor, targets: Tensor) -> Tensor:
    """Forward and backward of one micro-batch through the pipeline; returns the mean loss on
    every rank of the pipeline (see the module docstring)."""
    losses: list[Tensor] = []
    kwargs: dict[str, Any] = {"target": targets, "losses": losses} if pipe.is_last else {}
    if pipe.is_first:
        pipe.schedule.step(inputs, **kwargs)
    else:
        pipe.schedule.step(**kwargs)
    # The chunks' losses carry 1/chunks already: their sum is the mean over the micro-batch.
    loss = torch.stack(losses).sum().detach().float() if pipe.is_last else torch.zeros(())
    if pipe.scaler is not None and pipe.is_last:
        loss = loss / pipe.scaler.get_scale()  # a power of two: the division is exact
    dist.broadcast(loss, src=pipe.last_rank, group=pipe.group)
    return loss
