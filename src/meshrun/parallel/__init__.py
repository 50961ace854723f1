"""Parallel layouts: plain functions that change a model in place, called in one documented order.

``parallelize`` owns the order, as torchtitan does:

0. expert parallel (``apply_ep``, ``parallel.ep`` > 1): each MoE layer keeps this rank's
   experts and exchanges tokens with ``all_to_all`` over groups of ep data-parallel ranks
   (parallel/ep.py); the tensor-parallel plan then leaves the experts out;
1. tensor parallel (``apply_tp``) over the ``tp`` dim: parameters become DTensors (with
   ``loss_parallel`` the head too, its logits sharded over the vocabulary:
   :func:`maybe_loss_parallel` is the context the loss and its backward run in);
2. activation checkpointing of every k-th block (``apply_ac``);
3. ``torch.compile`` of each block in place (``apply_compile``, ``parallel.compile``);
4. data parallelism last, over the ``dp`` dims: FSDP2 (``zero`` 2/3, HSDP when dp_replicate > 1;
   each expert container first, its own unit over ``ep_replicate``) with its mixed-precision policy, or DDP (``zero`` 0/1; stage 1 shards the optimizer state
   in ``build_optimizer``; the experts left out and reduced over ``ep_replicate`` at the end of
   the backward) with its gradient-compression hook; under DDP a non-fp32
   ``param_dtype`` runs the forward under autocast (``apply_autocast``).

fp16 needs a loss scaler: :func:`build_grad_scaler` (used by ``run.backward`` and
``run.optimizer_step``) agrees on skipped steps across ranks.

Pipeline parallel (:func:`parallelize_pipeline`) splits first, then applies the same order to
each stage module on the non-pp sub-mesh.

A model built on the meta device is allocated after sharding and initialised with its
``init_weights()``, so no rank ever holds the whole model.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshrun._lazy import lazy_exports
from meshrun.config import ConfigError, ParallelConfig, check_expert_parallel, check_layout
from meshrun.parallel.ac import apply_ac
from meshrun.parallel.comm import apply_comm_hook
from meshrun.parallel.compile import apply_compile
from meshrun.parallel.ddp import apply_ddp, apply_replicate
from meshrun.parallel.ep import (
    EPLayout,
    apply_ep,
    apply_ep_fsdp,
    describe_ep,
    mark_expert_params,
    prepare_ddp,
    without_experts,
)
from meshrun.parallel.fsdp import WrapPredicate, apply_fsdp, has_meta_params, is_block, materialize
from meshrun.parallel.grads import clip_grad_norm_, set_grad_sync
from meshrun.parallel.norms import maybe_sync_batchnorm
from meshrun.parallel.precision import apply_autocast, build_grad_scaler, build_mp_policy
from meshrun.parallel.report import describe_layout
from meshrun.parallel.structure import ModelSpec, ModelStructure, find_structure
from meshrun.parallel.zero import build_optimizer, check_optimizer
from meshrun.runtime.mesh import ParallelDims, build_ep_mesh, fsdp_mesh, tp_mesh

__all__ = [
    "Pipeline",
    "apply_ac",
    "apply_comm_hook",
    "apply_compile",
    "apply_ddp",
    "apply_ep",
    "apply_fsdp",
    "apply_tp",
    "build_grad_scaler",
    "build_optimizer",
    "check_optimizer",
    "clip_grad_norm_",
    "data_parallel_stage",
    "default_tp_plan",
    "find_structure",
    "is_block",
    "maybe_loss_parallel",
    "parallelize",
    "parallelize_pipeline",
    "pipeline_eval",
    "pipeline_step",
    "set_grad_sync",
]

# FSDP, DTensor, tensor parallel and the pipeline modules (parallel/pp*.py) are imported where
# a layout first needs them (a plain DDP run never imports them: about a second of CPU, the
# pipeline's own modules 10-16 ms, at start-up).
if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from meshrun.parallel.pp.pipeline import LossFn, Pipeline, pipeline_eval, pipeline_step
    from meshrun.parallel.tp import TPPlan, apply_tp, default_tp_plan

log = logging.getLogger("meshrun")

# Tensor parallel (DTensor) and the pipeline load on first use (PEP 562). The pipeline's
# builders and its LossFn type are parallel/pp/pipeline.py's alone.
__getattr__ = lazy_exports(
    globals(),
    {
        "apply_tp": "meshrun.parallel.tp",
        "default_tp_plan": "meshrun.parallel.tp",
        "Pipeline": "meshrun.parallel.pp.pipeline",  # what parallelize_pipeline returns
        "pipeline_eval": "meshrun.parallel.pp.pipeline",
        "pipeline_step": "meshrun.parallel.pp.pipeline",
        "bind_tied": "meshrun.parallel.pp.tied",
    },
)

ParallelizeFn = Callable[[nn.Module, DeviceMesh], object]


def _shard(
    module: nn.Module,
    mesh: DeviceMesh,
    cfg: ParallelConfig,
    zero: int,
    mp_policy: MixedPrecisionPolicy | None,
    wrap: WrapPredicate,
) -> None:
    """FSDP2 over the data-parallel dims of ``mesh``, with the ``[parallel]`` FSDP settings."""
    apply_fsdp(
        module,
        fsdp_mesh(mesh),
        zero,
        cfg.cpu_offload,
        mp_policy,
        wrap,
        cfg.fsdp_prefetch,
        cfg.fsdp_blocks_per_unit,
    )


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    cfg: ParallelConfig,
    device: torch.device,
    *,
    tp_plan: TPPlan | None = None,
    parallelize_fn: ParallelizeFn | None = None,
    wrap: WrapPredicate | None = None,
    comm_hook_wrap: Callable[[Any], Any] | None = None,
    spec: ModelSpec | None = None,
) -> nn.Module:
    """Apply the configured layout to ``model`` and return a real torch module: the model itself
    (tensor parallel, FSDP2: changed in place) or, for DDP, the DDP wrapper around it.

    The model's structure (blocks, tied parameters, heads, TP plan) is read once by
    :func:`find_structure`, with ``spec`` (a :class:`ModelSpec`) first. ``tp_plan`` (module-name
    patterns to ParallelStyles or plan strings) replaces the structure's plan;
    ``parallelize_fn(model, mesh)`` replaces meshrun's tensor-parallel step entirely (it gets
    the whole mesh). ``wrap(name, module)`` chooses FSDP's and AC's units (default: the
    structure's blocks). ``comm_hook_wrap(hook)`` wraps DDP's comm hook (monitor/comm.py).
    """
    dims = dataclasses.replace(ParallelDims.from_mesh(mesh), ep=cfg.ep)
    check_whole_model_layout(cfg, dims, mesh)
    zero = data_parallel_stage(cfg, dims)
    check_offload(cfg, device)
    mp_policy = build_mp_policy(cfg, zero)  # checked before anything changes
    structure = find_structure(model, spec)
    log.info("model structure: %s", structure.describe())
    wrap = wrap or units_of(structure, cfg, zero, dims)
    meta = has_meta_params(model)
    if not meta:
        model = model.to(device)
    model = maybe_sync_batchnorm(model, mesh, cfg, device, broadcasts_buffers=zero < 2)
    ep = maybe_apply_ep(model, mesh, dims, device, spec)
    if ep is not None:  # the experts are split by expert: the TP plan leaves them out
        structure = dataclasses.replace(
            structure, tp_plan=without_experts(model, structure.tp_plan)
        )
    if mesh is not None and dims.cp > 1:  # before FSDP2/DDP: its pre-hook runs first
        from meshrun.parallel.cp import apply_cp

        log.info("context parallel over %d ranks: %s", dims.cp, apply_cp(model, mesh, structure))
    if mesh is not None:
        maybe_apply_tp(model, mesh, dims, cfg, tp_plan, parallelize_fn, structure)
    apply_block_layouts(model, mesh, cfg, dims, zero, mp_policy, wrap, ep)
    if meta:
        materialize(model, device)
    log.info(describe_layout(model, mesh, cfg, zero))
    if zero < 2:
        apply_autocast(model, cfg, device)
    out = model
    if mesh is not None and zero < 2 and dims.dp * dims.cp > 1:
        out = _ddp(model, mesh, cfg, device, dims, zero, comm_hook_wrap)
    if ep is not None:
        mark_expert_params(model)
    return out


def maybe_apply_ep(
    model: nn.Module,
    mesh: DeviceMesh | None,
    dims: ParallelDims,
    device: torch.device,
    spec: ModelSpec | None,
) -> EPLayout | None:
    """Expert parallel when ``parallel.ep`` > 1 (parallel/ep.py), else nothing. The layout is
    kept on the model for the gradient switch and the checkpoints."""
    if dims.ep == 1 or mesh is None:
        return None
    layout = apply_ep(model, build_ep_mesh(dims, device.type), dims.dp, spec)
    layout.dp_group = mesh.get_group("dp")
    model.__dict__["_meshrun_ep_layout"] = layout
    log.info(describe_ep(model, layout))
    return layout


def apply_block_layouts(
    model: nn.Module,
    mesh: DeviceMesh | None,
    cfg: ParallelConfig,
    dims: ParallelDims,
    zero: int,
    mp_policy: MixedPrecisionPolicy | None,
    wrap: WrapPredicate,
    ep: EPLayout | None = None,
) -> None:
    """What :func:`parallelize` applies per block, in its order: activation checkpointing,
    ``torch.compile``, then FSDP2 (zero 2/3) with each block its own unit (each expert
    container of ``ep`` before them, over its replicas)."""
    if cfg.activation_checkpoint:
        n = apply_ac(model, cfg.activation_checkpoint, wrap)
        log.info("activation checkpointing: %d blocks (every %d)", n, cfg.activation_checkpoint)
    if cfg.compile:
        log.info("torch.compile: %d blocks", apply_compile(model, wrap))
    if mesh is not None and zero >= 2:
        if ep is not None:
            apply_ep_fsdp(model, ep, zero, mp_policy)
        _shard(model, mesh, cfg, zero, mp_policy, wrap)
        log.info(
            "FSDP2 ZeRO-%d over %s (params %s, reduce %s)",
            *(zero, dims.describe(), cfg.param_dtype, cfg.reduce_dtype),
        )


def _ddp(
    model: nn.Module,
    mesh: DeviceMesh,
    cfg: ParallelConfig,
    device: torch.device,
    dims: ParallelDims,
    zero: int,
    comm_hook_wrap: Callable[[Any], Any] | None,
) -> nn.Module:
    layout = model.__dict__.get("_meshrun_ep_layout")
    if isinstance(layout, EPLayout):
        prepare_ddp(model, layout)
    ddp = apply_ddp(model, mesh, cfg, device)
    log.info(
        "DDP%s over %d ranks (bucket_cap_mb=%s, static_graph=%s, comm hook %s)",
        *(" + ZeRO-1" if zero == 1 else "", dims.dp * dims.cp, cfg.bucket_cap_mb),
        cfg.static_graph,
        apply_comm_hook(ddp, cfg, comm_hook_wrap),
    )
    return ddp


def check_whole_model_layout(
    cfg: ParallelConfig, dims: ParallelDims, mesh: DeviceMesh | None = None
) -> None:
    """What :func:`parallelize` refuses before anything changes: a pipelined mesh (driven by
    its schedule instead), loss parallel without a tp dim, and an ``ep`` the data-parallel
    ranks cannot hold."""
    if cfg.ep > 1:
        if mesh is None:
            raise ConfigError(
                f"parallel.ep = {cfg.ep} splits the experts over data-parallel ranks, but this "
                "process runs alone (no process group); launch more ranks or set parallel.ep=1"
            )
        check_expert_parallel(cfg, dims.dp, dims.describe())
    if dims.pp > 1:
        raise ConfigError(
            f"parallel.pp = {dims.pp}: a pipelined model is driven by its schedule, not called "
            "by the loop; use pipe = run.pipeline(model, loss_fn) and run.pipeline_step(pipe, "
            "inputs, targets) (docs/parallel.md), or set parallel.pp=1"
        )
    if cfg.loss_parallel and dims.tp == 1:
        raise ConfigError(
            f"parallel.loss_parallel = true splits the logits over the tp dim, but the mesh has "
            f"tp=1 ({dims.describe()}); set parallel.tp > 1 or parallel.loss_parallel=false"
        )


def units_of(
    structure: ModelStructure, cfg: ParallelConfig, zero: int, dims: ParallelDims
) -> WrapPredicate:
    """FSDP's and AC's units: the structure's blocks. With none found, FSDP2 makes the whole
    model one unit (one all-gather of every parameter) and AC has nothing to wrap: one warning
    says each that applies (runtime/logs.py prints it on rank 0)."""
    if structure.blocks_fqn is None:
        _warn_no_blocks(structure, zero >= 2 and dims.dp > 1, cfg.activation_checkpoint > 0)
    return structure.is_block


def _warn_no_blocks(structure: ModelStructure, fsdp: bool, ac: bool) -> None:
    effects = []
    if fsdp:
        effects.append("FSDP2 shards the whole model as one unit (all its parameters gathered)")
    if ac:
        effects.append("activation checkpointing wraps nothing")
    if effects:
        log.warning(
            "no repeated blocks found in %s: %s; pass run.parallelize(model, spec=ModelSpec("
            "blocks='path.to.blocks')) or wrap=...",
            structure.model_class,
            " and ".join(effects),
        )


def maybe_apply_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    dims: ParallelDims,
    cfg: ParallelConfig,
    tp_plan: TPPlan | None,
    parallelize_fn: ParallelizeFn | None,
    structure: ModelStructure | None = None,
) -> None:
    """The user's ``parallelize_fn``, else tensor parallel by ``tp_plan`` (or the structure's
    plan: parallel/structure.py) when the mesh has a tp dim > 1, else nothing."""
    if parallelize_fn is not None:
        parallelize_fn(model, mesh)
        return
    if dims.tp == 1:
        return
    from meshrun.parallel.tp import apply_tp, build_tp_plan, count_split
    from meshrun.parallel.tp_check import apply_checked_tp

    structure = structure or find_structure(model)
    if tp_plan is not None:
        structure = dataclasses.replace(
            structure, tp_plan=dict(tp_plan), tp_plan_source="tp_plan argument"
        )
    plan = build_tp_plan(model, structure, dims.tp, cfg.sequence_parallel, cfg.loss_parallel)
    tied = structure.tied
    # The plan is checked against the model's own forward on meta tensors before the model
    # changes (parallel/tp_check.py); context parallel's hooks exchange positions, so not there.
    checked = apply_checked_tp(
        *(model, plan, dims.tp),
        lambda m: apply_tp(m, tp_mesh(mesh), plan, tied),
        structure.example_input,
        check=dims.cp == 1,
        note=not cfg.compile,  # compiled blocks trace module hooks: no note there
    )
    extras = [("sequence parallel", cfg.sequence_parallel), ("loss parallel", cfg.loss_parallel)]
    log.info(
        "tensor parallel over %d ranks: %d modules split%s (plan: %s)",
        *(dims.tp, count_split(model), "".join(f" (+ {n})" for n, on in extras if on)),
        structure.tp_plan_source or "given",
    )
    log.info("tensor-parallel plan %s", checked.detail)


def maybe_loss_parallel(cfg: ParallelConfig) -> AbstractContextManager[None]:
    """``torch.distributed.tensor.parallel.loss_parallel()`` when ``parallel.loss_parallel``
    is on, else a no-op: the loss (cross-entropy on the vocab-sharded logits) and its backward
    must run inside it. ``run.loss_parallel()`` returns this; ``run.backward`` enters it too."""
    if not cfg.loss_parallel:
        return nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def check_offload(cfg: ParallelConfig, device: torch.device) -> None:
    """CPU offload moves shards from GPU memory to pinned host memory: on CPU it has no meaning
    (and FSDP2's pinning needs an accelerator), so it is an error, not a silent no-op."""
    if cfg.cpu_offload and device.type != "cuda":
        raise ConfigError(
            f"parallel.cpu_offload = true needs CUDA devices, but this run is on {device.type}: "
            "the parameters already live in host memory; set parallel.cpu_offload=false"
        )
    if cfg.cpu_offload and cfg.zero < 2:
        raise ConfigError(
            f"parallel.cpu_offload = true is an FSDP2 option (zero 2 or 3), but parallel.zero = "
            f"{cfg.zero}; set parallel.zero=3 or parallel.cpu_offload=false"
        )


def data_parallel_stage(cfg: ParallelConfig, dims: ParallelDims) -> int:
    """The ZeRO stage that runs: ``cfg.zero``, except that DDP (zero = 0) cannot take tensor-
    parallel DTensor parameters, so tp x dp runs FSDP2 ZeRO-3, with a warning that says so."""
    if cfg.zero == 0 and dims.tp > 1 and dims.dp > 1:
        log.warning(
            "parallel.zero = 0 (DDP) cannot take tensor-parallel parameters: data parallelism "
            "over %s runs as FSDP2 ZeRO-3; set parallel.zero=3 (or 2) to say so",
            dims.describe(),
        )
        return 3
    return cfg.zero


def parallelize_pipeline(
    model: nn.Module,
    mesh: DeviceMesh,
    cfg: ParallelConfig,
    device: torch.device,
    loss_fn: LossFn,
    *,
    tp_plan: TPPlan | None = None,
    wrap: WrapPredicate = is_block,
    scaler: ShardedGradScaler | None = None,
    spec: ModelSpec | None = None,
) -> Pipeline:
    """Pipeline parallel: split ``model`` into this rank's stages, then parallelize each stage
    module on the non-pp sub-mesh in the order of :func:`parallelize` (tensor parallel, AC,
    compile, then FSDP2 or DDP over the dp dims), then build the schedule. The user's loop
    calls :func:`pipeline_step` instead of the model (see ``parallel/pp/pipeline.py``); under fp16
    ``scaler`` (:func:`build_grad_scaler`) scales each chunk's loss inside the schedule.
    ``spec`` tells meshrun the model's structure where it cannot find it (its blocks, split
    points, tied pairs: parallel/structure.py); tied parameters on two stages stay tied."""
    # Only a pipelined run pays for importing the pipeline's modules.
    from meshrun.parallel.pp.pipeline import build_pipeline, build_stage_modules
    from meshrun.parallel.pp.tied import bind_tied

    dims = ParallelDims.from_mesh(mesh)
    check_layout(cfg, vars(dims))  # e.g. tp x ZeRO-1, pp_microbatches < pp
    _check_pipeline_scaler(cfg, dims, scaler)
    zero = data_parallel_stage(cfg, dims)
    check_offload(cfg, device)
    mp_policy = build_mp_policy(cfg, zero)  # checked before anything changes
    if not has_meta_params(model):  # on meta each rank allocates its stages (parallel/pp/meta.py)
        model = model.to(device)
    stages = build_stage_modules(model, mesh, cfg, spec)
    log.info(stages.describe)
    modules = [
        parallelize_stage(
            *(m, mesh, dims, cfg, device, zero, mp_policy, tp_plan, wrap),
            stages.structure_of(m),
        )
        for m in stages.modules
    ]
    stages.materialize(modules, device)
    log.info(
        "pipeline: %d stage(s) on this rank of %d, schedule %s, %d chunks per micro-batch",
        *(len(modules), dims.pp * len(modules), cfg.pp_schedule, cfg.pp_microbatches),
    )
    pipe = build_pipeline(modules, mesh, cfg, loss_fn, device, scaler)
    pipe.tied = bind_tied(stages.tied, modules, stages.ids, mesh)
    return pipe


def _check_pipeline_scaler(
    cfg: ParallelConfig, dims: ParallelDims, scaler: ShardedGradScaler | None
) -> None:
    """fp16 under a pipeline scales each chunk's loss inside the schedule: it needs the scaler."""
    if cfg.param_dtype == "float16" and scaler is None:
        raise ConfigError(
            f"parallel.pp = {dims.pp} with parallel.param_dtype = 'float16' needs a loss scaler "
            "inside the schedule: use run.pipeline(model, loss_fn), or pass "
            "scaler=build_grad_scaler(cfg, device) to parallelize_pipeline"
        )


def parallelize_stage(
    stage: nn.Module,
    mesh: DeviceMesh,
    dims: ParallelDims,
    cfg: ParallelConfig,
    device: torch.device,
    zero: int,
    mp_policy: MixedPrecisionPolicy | None,
    tp_plan: TPPlan | None,
    wrap: WrapPredicate,
    structure: ModelStructure | None = None,
) -> nn.Module:
    """One pipeline stage module, parallelized in place like a whole model by
    :func:`parallelize`: TP, AC, compile, then FSDP2 (zero 2/3) or replication (zero 0/1, see
    :func:`apply_replicate`) over the dp dims. ``structure``: the whole model's, as this stage
    sees it (``Stages.structure_of``): the stage keeps the model's FQNs, so its TP plan and
    head counts apply."""
    if cfg.loss_parallel and not getattr(stage, "is_last", True):
        cfg = dataclasses.replace(cfg, loss_parallel=False)  # only the last stage has the head
    stage = maybe_sync_batchnorm(stage, mesh, cfg, device, broadcasts_buffers=False)
    maybe_apply_tp(stage, mesh, dims, cfg, tp_plan, None, structure)
    if cfg.activation_checkpoint:
        apply_ac(stage, cfg.activation_checkpoint, wrap)
    if cfg.compile:
        apply_compile(stage, wrap)
    if zero >= 2:
        _shard(stage, mesh, cfg, zero, mp_policy, wrap)
        return stage
    apply_autocast(stage, cfg, device)
    if dims.dp > 1:
        apply_replicate(stage, mesh)
    return stage
