"""``Run``'s model methods: the layout (``parallelize``, ``pipeline``), the pipeline's step and
evaluation, the optimizer that fits the layout (with parameter groups), the user's module
inside the layout (``unwrap``), pretrained weights in, and the model's FLOPs for MFU. Each calls a
plain function of ``meshrun.parallel`` / ``meshrun.monitor`` with the run's state."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshrun.config import ConfigError
from meshrun.monitor.mfu import ModelFlops, constant_per_token, model_flops, start_mfu
from meshrun.parallel import build_grad_scaler, build_optimizer, parallelize, parallelize_pipeline
from meshrun.parallel.ep import layout_of, user_module
from meshrun.parallel.ep_dispatch import ep_state
from meshrun.parallel.pp.kind import is_pipeline
from meshrun.train.base import RunFields

if TYPE_CHECKING:  # FSDP's scaler is imported only by an fp16 run (build_grad_scaler)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from meshrun.hf.experts import ExpertShare
    from meshrun.parallel import Pipeline  # parallel/pp*.py load only when one is built


class ModelMethods(RunFields):
    """The model half of :class:`meshrun.Run` (a mixin: ``Run`` holds the state)."""

    def parallelize(self, model: nn.Module, **options: Any) -> nn.Module:
        """Apply the configured layout (see ``meshrun.parallel.parallelize`` for ``options``:
        ``tp_plan``, ``parallelize_fn``, ``wrap``); returns a real torch module: the model,
        changed in place, or its DDP wrapper."""
        options.setdefault("comm_hook_wrap", self.loop.monitor.comm_hook_wrap())
        self.set_model_flops(model_flops(model, self.config.metrics.flops_per_sample))
        out = parallelize(model, self.mesh, self.config.parallel, self.device, **options)
        self.state.models.append(out)
        if self.state.scaler is None:
            self.state.scaler = build_grad_scaler(self.config.parallel, self.device)
        return out

    @property
    def grad_scaler(self) -> ShardedGradScaler | None:
        """The fp16 loss scaler (``parallel.param_dtype = float16``, after :meth:`parallelize`),
        else None; ``run.backward``/``run.optimizer_step`` use it and ``run.resume`` saves it."""
        return self.state.scaler

    def pipeline(
        self,
        model: nn.Module,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        **options: Any,
    ) -> Pipeline:
        """Pipeline parallel (``parallel.pp > 1``): this rank's stages and their schedule. The
        loop calls ``run.pipeline_step(pipe, inputs, targets)`` instead of the model and
        ``run.backward``; the optimizer takes ``pipe.parameters()``. See parallel/pp/pipeline.py.
        ``options`` go to ``meshrun.parallel.parallelize_pipeline`` (``spec``, ``tp_plan``)."""
        if self.mesh is None:
            raise ConfigError("run.pipeline needs a process group: start with parallel.pp > 1")
        accum = self.accum

        def scaled(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss_fn(output, target) / accum  # what run.backward does, per chunk

        if self.state.scaler is None:  # fp16: the schedule scales each chunk's loss
            self.state.scaler = build_grad_scaler(self.config.parallel, self.device)
        self.set_model_flops(model_flops(model, self.config.metrics.flops_per_sample))
        pipe = parallelize_pipeline(
            *(model, self.mesh, self.config.parallel, self.device, scaled),
            scaler=self.state.scaler,
            **options,
        )
        self.state.models.extend(pipe.modules)
        self.state.pp_group = pipe.group
        return pipe

    def pipeline_step(
        self, pipe: Pipeline, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """Forward + backward of this micro-batch through the pipeline; returns its mean loss
        (on every rank) and counts it in the metrics."""
        from meshrun.parallel.pp.pipeline import pipeline_step  # loaded already: pipe is a Pipeline

        loss = pipeline_step(pipe, inputs, targets) * self.accum
        self.loop.record_loss(loss)
        return loss

    def pipeline_eval(
        self, pipe: Pipeline, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """Forward only (evaluation): this micro-batch's mean loss on every rank of the
        pipeline, not counted in the training metrics (see parallel/pp/pipeline.py ``pipeline_eval``)."""
        from meshrun.parallel.pp.pipeline import pipeline_eval  # loaded already: pipe is a Pipeline

        return pipeline_eval(pipe, inputs, targets) * self.accum  # loss_fn carries 1/accum

    def optimizer(
        self,
        model: nn.Module | Pipeline,
        optimizer_class: type[torch.optim.Optimizer],
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        """``optimizer_class(model.parameters(), **kwargs)``; under ``parallel.zero = 1`` its
        state is sharded over the data-parallel ranks (a ZeroRedundancyOptimizer). Build it
        after :meth:`parallelize` / :meth:`pipeline` (FSDP2 and TP replace the parameters).

        ``param_groups``: torch's parameter groups instead of ``model.parameters()``, e.g.
        ``[{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]``
        made from the parallelized model; every trainable parameter must be in one group."""
        cfg = self.config.parallel
        return build_optimizer(model, optimizer_class, self.mesh, cfg, param_groups, **kwargs)

    def unwrap(self, model: nn.Module | Pipeline) -> nn.Module:
        """The user's own module inside what :meth:`parallelize` returned: DDP's ``.module``,
        ``torch.compile``'s original module; FSDP2, TP and activation checkpointing change the
        module in place, so it is the module itself. Its own methods (``generate``,
        ``configure_optimizers``, ...) are reachable through it; under ZeRO-3/TP its parameters
        are sharded DTensors. A :class:`Pipeline` has no whole model on any rank: refused."""
        return unwrap_module(model)

    def load_pretrained(self, model: nn.Module | Pipeline, directory: str | Path) -> Any:
        """Load a Hugging Face directory (``config.json`` + safetensors) into ``model``, built
        (on the meta device, or not) and already parallelized: each rank reads only the slices
        it holds (under ``parallel.ep`` its own experts only). Call it on every rank; returns
        ``meshrun.hf.load.load_pretrained``'s report."""
        from meshrun.hf.load import load_pretrained  # the safetensors side: only when used

        shares = [] if is_pipeline(model) else expert_shares(cast(nn.Module, model))
        return load_pretrained(model, directory, device=self.device, experts=shares)

    def set_flops_per_token(self, flops_per_token: float) -> None:
        """Report MFU in the metrics. ``flops_per_token``: the model's training FLOPs per token
        (forward + backward, e.g. the planner's formula: docs/plan.md); the peak comes from
        ``metrics.peak_flops`` or the GPU table (monitor/mfu.py). ``metrics.flops_per_sample``
        and Hugging Face causal LMs need no call (``run.parallelize`` sets them)."""
        self.set_model_flops(constant_per_token(flops_per_token, "run.set_flops_per_token"))

    def set_model_flops(self, flops: ModelFlops | None) -> None:
        """Report MFU from ``flops`` (per sample or per token, monitor/mfu.py); None: none."""
        if flops is not None:
            line = start_mfu(self.metrics, flops, self.config, self.device)
            if self.is_main:
                self.log.info(line)


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
