"""The model side of :class:`meshrun.Run`, as plain functions over explicit parts: the layout
(``parallelize``, ``pipeline``), the pipeline's step and evaluation, the user's module inside
the layout (``unwrap``), pretrained weights in, and the model's FLOPs for MFU. Each calls
``meshrun.parallel`` / ``meshrun.monitor`` and records what it built in the train state of the
run's :class:`~meshrun.train.machinery.Machinery`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.config import Config, ParallelConfig
from meshrun.monitor import MetricsLogger
from meshrun.monitor.mfu import ModelFlops, start_mfu
from meshrun.parallel import build_grad_scaler, parallelize, parallelize_pipeline
from meshrun.parallel.ep import layout_of, user_module
from meshrun.parallel.ep_dispatch import ep_state
from meshrun.parallel.pp.kind import is_pipeline
from meshrun.train.loop import StepLoop
from meshrun.train.machinery import Machinery

if TYPE_CHECKING:
    from meshrun.hf.experts import ExpertShare
    from meshrun.parallel import Pipeline  # parallel/pp*.py load only when one is built


def parallelize_model(
    model: nn.Module,
    mesh: DeviceMesh | None,
    cfg: ParallelConfig,
    parts: Machinery,
    **options: Any,
) -> nn.Module:
    """``run.parallelize``: the configured layout applied, the result recorded as a model of
    the run, and the fp16 scaler built once (``parallel.param_dtype = float16``)."""
    out = parallelize(model, mesh, cfg, parts.device, **options)
    parts.state.models.append(out)
    if parts.state.scaler is None:
        parts.state.scaler = build_grad_scaler(cfg, parts.device)
    return out


def pipeline_model(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    mesh: DeviceMesh,
    cfg: ParallelConfig,
    parts: Machinery,
    **options: Any,
) -> Pipeline:
    """``run.pipeline``: this rank's stages and their schedule, each chunk's loss divided by
    the accumulation (what ``run.backward`` does), recorded in the run's state."""
    accum, device, state = parts.accum, parts.device, parts.state

    def scaled(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target) / accum  # what run.backward does, per chunk

    if state.scaler is None:  # fp16: the schedule scales each chunk's loss
        state.scaler = build_grad_scaler(cfg, device)
    pipe = parallelize_pipeline(*(model, mesh, cfg, device, scaled), scaler=state.scaler, **options)
    state.models.extend(pipe.modules)
    state.pp_group = pipe.group
    return pipe


def pipeline_train_step(
    pipe: Pipeline, inputs: torch.Tensor, targets: torch.Tensor, accum: int, loop: StepLoop
) -> torch.Tensor:
    """``run.pipeline_step``: forward + backward of one micro-batch, its mean loss counted."""
    from meshrun.parallel.pp.pipeline import pipeline_step  # loaded already: pipe is a Pipeline

    loss = pipeline_step(pipe, inputs, targets) * accum
    loop.record_loss(loss)
    return loss


def pipeline_eval_loss(
    pipe: Pipeline, inputs: torch.Tensor, targets: torch.Tensor, accum: int
) -> torch.Tensor:
    """``run.pipeline_eval``: one micro-batch's mean loss, forward only, not counted."""
    from meshrun.parallel.pp.pipeline import pipeline_eval  # loaded already: pipe is a Pipeline

    return pipeline_eval(pipe, inputs, targets) * accum  # loss_fn carries 1/accum


def unwrap_module(model: nn.Module | Pipeline) -> nn.Module:
    """``run.unwrap``: DDP's and ``torch.compile``'s wrappers peeled off, in any order."""
    if is_pipeline(model):
        raise TypeError(
            "run.unwrap(Pipeline): under pipeline parallelism no rank holds the whole model; "
            "this rank's stages are pipe.modules (each a real module: "
            "[run.unwrap(m) for m in pipe.modules])"
        )
    module = cast(nn.Module, model)  # not a Pipeline (TypeGuard narrows only if True)
    while True:
        inner = module.module if isinstance(module, DDP) else getattr(module, "_orig_mod", None)
        if not isinstance(inner, nn.Module):  # _orig_mod: torch.compile's OptimizedModule
            return module
        module = inner


def load_pretrained_into(
    model: nn.Module | Pipeline, directory: str | Path, device: torch.device
) -> Any:
    """``run.load_pretrained``: each rank reads the slices it holds (under ``parallel.ep`` its
    own experts only)."""
    from meshrun.hf.load import load_pretrained  # the safetensors side: only when used

    shares = [] if is_pipeline(model) else expert_shares(cast(nn.Module, model))
    return load_pretrained(model, directory, device=device, experts=shares)


def expert_shares(model: nn.Module) -> list[ExpertShare]:
    """This rank's share of each expert-parallel MoE layer of ``model`` (none without ep), as
    ``load_pretrained`` reads them: which experts, under which names."""
    from meshrun.hf.experts import ExpertShare
    from meshrun.hf.names import clean_name  # hf/ loads safetensors: only when used

    if layout_of(model) is None:
        return []
    return [
        ExpertShare(
            clean_name(name),
            s.num_experts,
            s.rank * s.n_local,
            s.n_local,
            s.dim,
            tuple(s.list_names),
        )
        for name, m in user_module(model).named_modules()
        if (s := ep_state(m)) is not None
    ]


def report_model_flops(
    flops: ModelFlops | None,
    metrics: MetricsLogger,
    cfg: Config,
    device: torch.device,
    log: logging.Logger | None,
) -> None:
    """``run.set_model_flops``: MFU in the metrics from ``flops`` (None: no MFU); the line
    that says so goes to ``log`` (the main rank's)."""
    if flops is not None:
        line = start_mfu(metrics, flops, cfg, device)
        if log is not None:
            log.info(line)
