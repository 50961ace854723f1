"""``meshrun.init()`` and the :class:`Run` it returns: one class whose ``__init__`` reads the
start-up order top to bottom (train/startup.py holds its steps) and whose public methods are
each a short call into a plain function (train/model.py, data.py, stepping.py, evaluate.py, or
the subsystem's own), which take the run's one ``Machinery`` whole (train/machinery.py). The
machinery and the step loop built from it are private; what a script reads of them is a
property (``grad_norm``, ``data_wait``)."""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset

from meshrun.checkpoint import Stateful
from meshrun.config import Config, ConfigError, grad_accumulation, validate_for_world, write_config
from meshrun.data import ResumableSampler
from meshrun.monitor.comm import CommHook
from meshrun.monitor.mfu import ModelFlops, constant_per_token, model_flops
from meshrun.parallel import build_optimizer, maybe_loss_parallel
from meshrun.runtime.launcher_env import LauncherEnv, detect
from meshrun.runtime.logs import init_logging, report_uncaught
from meshrun.runtime.mesh import ParallelDims
from meshrun.train import data as _data
from meshrun.train import evaluate as _evaluate
from meshrun.train import model as _model
from meshrun.train import stepping as _stepping
from meshrun.train.fit import check_fit
from meshrun.train.loop import StepLoop
from meshrun.train.machinery import Machinery
from meshrun.train.startup import (
    build_machinery,
    init_seeds,
    mesh_text,
    open_run_dir,
    resolve_batch,
    resolve_config,
    shut_down,
    start_process,
)

if TYPE_CHECKING:  # FSDP's scaler loads only in an fp16 run, parallel/pp*.py with a pipeline
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from meshrun.parallel import Pipeline

_ACTIVE: Run | None = None
_RETIRED: list[Run] = []  # closed runs, never destroyed before exit (see Run.close)
_FAILED = False  # set by our excepthook: an uncaught exception must skip the final barrier


class Run:
    """The runtime of one training process. Create it with :func:`init`.

    Its fields are set once by ``__init__`` and are read-only for scripts (docs/porting.md
    lists them); its methods are the calls a training loop makes (docs/porting.md)."""

    config: Config
    cluster: LauncherEnv
    rank: int
    world_size: int
    local_rank: int
    dims: ParallelDims
    device: torch.device
    backend: str
    mesh: DeviceMesh | None
    dp_size: int
    dp_rank: int
    accum: int
    is_main: bool
    run_dir: Path
    log: logging.Logger
    _parts: Machinery
    _loop: StepLoop

    def __init__(self, cfg: Config, env: LauncherEnv) -> None:
        self.config, self.cluster = cfg, env
        self.rank, self.world_size, self.local_rank = env.rank, env.world_size, env.local_rank
        # 1. Every check before any effect: each value (also attributes set after the Config
        # was built), the mesh dims and every world-size check, as the launcher did. An unset
        # global batch is the resumed checkpoint's, else derived from this world: from here on
        # everything (loop, sampler, checkpoints, LR) sees the number.
        self.dims = ParallelDims(**validate_for_world(cfg, env.world_size), ep=cfg.parallel.ep)
        self._batch_source = resolve_batch(cfg, env.world_size)
        self._default_run_dir = not cfg.job.run_dir
        # 2. The process: device, process group, mesh; the batch arithmetic over them (replica
        # groups split the global batch over every group's data-parallel ranks).
        self.device, self.backend, self.mesh = start_process(cfg, env, self.dims)
        self.dp_size, self.dp_rank = self.dims.dp, self.dims.dp_rank(self.rank)
        self.accum = grad_accumulation(cfg.data, self.dp_size, cfg.fault_tolerance.replica_groups)
        self.is_main = self.rank == 0
        # 3. The run directory, this rank's log, the seeds.
        self.run_dir = open_run_dir(cfg, env.hostname)
        self.log = init_logging(self.rank, self.run_dir, cfg.job.log_level, self.local_rank)
        init_seeds(cfg.job.seed, self.rank)
        # 4. The machinery the methods drive (metrics, train state, monitor, checkpoints) and
        # the step loop built whole from it.
        self._parts = build_machinery(cfg, self.run_dir, self.accum, self.device, self.mesh, env)
        self._loop = StepLoop(self._parts)
        self._closed = False
        # 5. Said once: the resolved config, the start line, the `start` event.
        _record_start(self)

    # --- the model and its layout (train/model.py) --------------------------------------

    def parallelize(self, model: nn.Module, **options: Any) -> nn.Module:
        """Apply the configured layout (see ``meshrun.parallel.parallelize`` for ``options``:
        ``tp_plan``, ``parallelize_fn``, ``wrap``); returns a real torch module: the model,
        changed in place, or its DDP wrapper."""
        options.setdefault("comm_hook_wrap", self._parts.monitor.comm_hook_wrap())
        self.set_model_flops(model_flops(model, self.config.metrics.flops_per_sample))
        check_fit(model, self.mesh, self.config, self.device)  # before step 1: train/fit.py
        self._parts.former.remember(model)  # names an optimizer built before this (optim_params)
        return _model.parallelize_model(
            model, self.mesh, self.config.parallel, self._parts, **options
        )

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
        self.set_model_flops(model_flops(model, self.config.metrics.flops_per_sample))
        self._parts.former.remember(model)
        cfg = self.config.parallel
        return _model.pipeline_model(model, loss_fn, self.mesh, cfg, self._parts, **options)

    def pipeline_step(
        self, pipe: Pipeline, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """Forward + backward of this micro-batch through the pipeline; returns its mean loss
        (on every rank) and counts it in the metrics."""
        return _model.pipeline_train_step(pipe, inputs, targets, self.accum, self._loop)

    def pipeline_eval(
        self, pipe: Pipeline, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """Forward only (evaluation): this micro-batch's mean loss on every rank of the
        pipeline, not counted in the training metrics (see parallel/pp/pipeline.py
        ``pipeline_eval``)."""
        return _model.pipeline_eval_loss(pipe, inputs, targets, self.accum)

    def optimizer(
        self,
        model: nn.Module | Pipeline,
        optimizer_class: type[torch.optim.Optimizer],
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        """``optimizer_class(model.parameters(), **kwargs)``; under ``parallel.zero = 1`` its
        state is sharded over the data-parallel ranks (a ZeroRedundancyOptimizer). Build it
        after :meth:`parallelize` / :meth:`pipeline` (FSDP2 and TP replace the parameters);
        FSDP2 units are resharded first, and the first :meth:`optimizer_step` of any optimizer
        refuses one holding a tensor the model no longer uses (parallel/optim_params.py).

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
        return _model.unwrap_module(model)

    def load_pretrained(self, model: nn.Module | Pipeline, directory: str | Path) -> Any:
        """Load a Hugging Face directory (``config.json`` + safetensors) into ``model``, built
        (on the meta device, or not) and already parallelized: each rank reads only the slices
        it holds (under ``parallel.ep`` its own experts only). Call it on every rank; returns
        ``meshrun.hf.load.load_pretrained``'s report."""
        return _model.load_pretrained_into(model, directory, self.device)

    def set_flops_per_token(self, flops_per_token: float) -> None:
        """Report MFU in the metrics. ``flops_per_token``: the model's training FLOPs per token
        (forward + backward, e.g. the planner's formula: docs/plan.md); the peak comes from
        ``metrics.peak_flops`` or the GPU table (monitor/mfu.py). ``metrics.flops_per_sample``
        and Hugging Face causal LMs need no call (``run.parallelize`` sets them)."""
        self.set_model_flops(constant_per_token(flops_per_token, "run.set_flops_per_token"))

    def set_model_flops(self, flops: ModelFlops | None) -> None:
        """Report MFU from ``flops`` (per sample or per token, monitor/mfu.py); None: none."""
        log = self.log if self.is_main else None
        _model.report_model_flops(flops, self._parts.metrics, self.config, self.device, log)

    @property
    def grad_scaler(self) -> ShardedGradScaler | None:
        """The fp16 loss scaler (``parallel.param_dtype = float16``, after :meth:`parallelize`),
        else None; ``run.backward``/``run.optimizer_step`` use it and ``run.resume`` saves it."""
        return self._parts.state.scaler

    # --- data and learning rate (train/data.py) -----------------------------------------

    def scaled_lr(self, base_lr: float | None = None) -> float:
        """``base_lr`` (default ``optim.lr``) scaled by ``optim.lr_scaling`` to the global batch."""
        return _data.scaled_lr(self.config, base_lr, self.log if self.is_main else None)

    def lr_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """Warmup + decay from ``[optim]``; stepped by ``run.optimizer_step``."""
        return _data.registered_lr_scheduler(optimizer, self.config.optim, self._parts.state)

    def sampler(
        self, dataset_len: int, *, mode: Literal["train", "eval"] = "train"
    ) -> ResumableSampler:
        """A :class:`ResumableSampler` over ``dataset_len`` samples for this rank's data-parallel
        share: ``train``, one stream of epochs (shuffled when ``data.shuffle``) whose position
        resumes on any number of ranks; ``eval``, each sample exactly once, in order, unpadded."""
        return _data.rank_sampler(dataset_len, mode, self.config, self.dp_rank, self.dp_size)

    def dataloader(
        self,
        dataset: Dataset[Any],
        micro_batch: int | None = None,
        *,
        mode: Literal["train", "eval"] = "train",
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> DataLoader[Any]:
        """A DataLoader over this rank's share, in a world-size-independent resumable order."""
        place = {"rank": self.rank, "dp_rank": self.dp_rank, "dp_size": self.dp_size}
        return _data.rank_dataloader(
            dataset, micro_batch, mode, collate_fn, self.config, **place, device=self.device
        )

    def steps(
        self, loader: Iterable[Any], steps: int | None = None, tokens_per_sample: int | None = None
    ) -> Iterator[Any]:
        """Micro-batches on the device until ``optim.steps`` optimizer steps (see train/loop.py)."""
        if tokens_per_sample is None:  # 0 in the config: not known
            tokens_per_sample = self.config.metrics.tokens_per_sample or None
        return self._loop.steps(loader, steps, tokens_per_sample)

    @property
    def data_wait(self) -> float:
        """Seconds this rank waited on its loader during the last optimizer step (0.0 before
        the first); ``metrics.jsonl`` has rank 0's as ``data_wait_s`` (docs/data.md)."""
        return self._loop.last_data_wait_s

    # --- the step (train/stepping.py, train/loop.py) ------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss / accumulation).backward()``; see train/loop.py for why this is the right scale.
        Under ``parallel.loss_parallel`` the backward runs inside ``loss_parallel()`` too."""
        _stepping.backward(loss, self.config.parallel, self._parts, self._loop)

    def loss_parallel(self) -> AbstractContextManager[None]:
        """Compute the loss inside this (``with run.loss_parallel(): loss = ...``): with
        ``parallel.loss_parallel`` the logits are sharded over the vocabulary and cross-entropy
        must run under ``torch.distributed.tensor.parallel.loss_parallel()``; else a no-op."""
        return maybe_loss_parallel(self.config.parallel)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step (and zero) ``optimizer`` at the end of an accumulation window and advance what
        moves with it (registered LR schedulers, the sampler's position, metrics, interval
        checkpoints); return whether this micro-step was the window's last (else nothing ran).
        A step the numerics guard skips still counts; under replica groups a step the quorum
        does not commit does not (False)."""
        cfg = self.config.parallel
        return _stepping.optimizer_step(optimizer, cfg, self.dp_size, self._parts, self._loop)

    def phase(self, name: str, timeout_s: float | None = None) -> AbstractContextManager[None]:
        """``with run.phase("eval"):`` gives the block the hang watchdog's longer limit
        (``timeout_s``, default ``monitor.phase_timeout_s``) instead of the step timeout."""
        return self._parts.monitor.phase(name, timeout_s)

    @property
    def step(self) -> int:
        """Optimizer steps done so far. With gradient accumulation it holds for all the
        micro-steps of a window: guard per-step work with ``run.is_step_end`` too."""
        return self._parts.state.step

    @property
    def is_step_end(self) -> bool:
        """True on the micro-step whose ``run.optimizer_step`` steps the optimizer (the last
        of its accumulation window; every micro-step without accumulation), before and after
        that call. ``if run.is_step_end and run.step % 100 == 0:`` runs once per 100 steps,
        where ``run.step % 100 == 0`` alone runs on every micro-step of the window."""
        return self._loop.is_step_end

    @property
    def grad_norm(self) -> float:
        """The whole gradient's 2-norm before clipping at the last optimizer step, the same on
        every rank and layout (the step line's ``grad_norm``); taken only with
        ``optim.grad_clip > 0``, else NaN (docs/monitor.md)."""
        return self._loop.grad_norm

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (e.g. eval loss sums and counts, once at the end)."""
        return _stepping.all_reduce_dp(value, self.mesh)

    def timed_comm_hook(self, hook: CommHook) -> CommHook:
        """``hook`` (a DDP comm hook) with its communication timed in the step's
        ``comm_exposed_s``: register the result on the DDP model :meth:`parallelize` returns,
        before the first step (a hook registered as it is is left untimed; docs/monitor.md)."""
        return self._parts.monitor.comm.wrap(hook)

    # --- checkpoints (train/stepping.py, checkpoint/) -----------------------------------

    def resume(
        self,
        model: nn.Module | Pipeline,
        optimizer: torch.optim.Optimizer,
        loader: Any = None,
        per_rank: Mapping[str, Stateful] | None = None,
        **named: Stateful,
    ) -> int:
        """Register what is checkpointed (model, optimizer, the loader's data position, user
        objects by name; schedulers from ``run.lr_scheduler`` are included) and load the
        checkpoint chosen by ``checkpoint.resume``. Returns the step resumed at (0 = fresh).

        Objects by name (``sched=scheduler``) are replicated: the same on every rank (checked
        at each save). ``per_rank={"hidden": obj}``: objects whose state is each rank's own,
        saved and restored per rank (same world size; another one is refused). Every object
        is saved at the end of the step's loop body, with the model and optimizer of that
        step (docs/checkpoint.md, Your own state)."""
        return _stepping.resume(model, optimizer, loader, per_rank, named, self._parts)

    def save_checkpoint(self) -> Path:
        """Checkpoint the current step now (collective: call on every rank)."""
        with self.phase("checkpoint"):
            return self._parts.checkpointer.save()

    # --- evaluation and metrics (train/evaluate.py, monitor/) ---------------------------

    def evaluate(
        self,
        model: nn.Module | Pipeline,
        batches: Iterable[Any],
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        max_batches: int | None = None,
    ) -> float:
        """The mean loss over ``batches`` (this rank's share, e.g. ``run.dataloader(val,
        mode="eval")``), weighted by batch size and summed over the data-parallel ranks; the
        same float on every rank. Call it on every rank. Runs under ``torch.no_grad()`` with
        every module in eval mode, then restores each module's mode.

        ``loss_fn(model, batch)`` returns the batch's mean loss (the batch moved to the device;
        its size is its first tensor's first dim). Under pipeline parallelism ``loss_fn`` may be
        omitted: each batch is ``(inputs, targets)`` and the loss is the one given to
        ``run.pipeline`` (``run.pipeline_eval``). ``max_batches``: at most that many per rank.

        Its time is not step time: the next step's line has it as ``eval_s``, and an ``eval``
        event in metrics.jsonl has the loss and the seconds."""
        return _evaluate.evaluate(
            model, batches, loss_fn, max_batches, self.mesh, self.dp_size, self._parts, self._loop
        )

    def log_event(self, event: str, **fields: Any) -> None:
        """Append ``{"event": event, "time": ..., **fields}`` to ``metrics.jsonl`` (rank 0
        writes it; a call on the other ranks does nothing), e.g. a validation loss of your own:
        ``run.log_event("eval", at_step=run.step, val_loss=loss)``."""
        self._parts.metrics.log_event(event, **fields)

    def summary(self) -> dict[str, float]:
        """This rank's totals so far: steps, time, median/mean step time, throughput
        (``tokens_per_s``, ``samples_per_s``), loss, peak memory; what the summary record of
        ``metrics.jsonl`` holds at the end (docs/monitor.md)."""
        return self._parts.metrics.summary()

    # --- teardown ------------------------------------------------------------------------

    def close(self, failed: bool = False) -> None:
        """Final summary, barrier (on success) and ``destroy_process_group``; idempotent."""
        global _ACTIVE
        if self._closed:
            return
        self._closed = True
        shut_down(self._parts, self.run_dir, failed)
        if _ACTIVE is self:
            _ACTIVE = None
        # Keep this Run (and with it DDP's reducer and the Gloo groups) alive to the end of the
        # process: their destructors join Gloo threads, and that join was seen to hang forever
        # after destroy_process_group(); @meshrun.main then leaves through os._exit.
        _RETIRED.append(self)

    def __enter__(self) -> Run:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(failed=exc is not None)


def _record_start(run: Run) -> None:
    """The resolved config and the start line (main rank), then the ``start`` event: one line
    per process start, from which ``meshrun report`` reads the world size, the batch
    arithmetic and the restarts (a second start in the same file)."""
    if run.is_main:
        write_config(run.config, run.run_dir / "config.toml")
        _announce(run)
    run._parts.metrics.log_event(
        "start",
        world_size=run.world_size,
        dp=run.dp_size,
        global_batch=run.config.data.global_batch,
        micro_batch=run.config.data.micro_batch,
        accum=run.accum,
        device=run.device.type,
        host=run.cluster.hostname,
    )


def _announce(run: Run) -> None:
    c = run.config
    groups = c.fault_tolerance.replica_groups
    run.log.info(
        "%d process(es) [%s] on %s + %s | mesh %s | global batch %d%s = micro %d x accum %d"
        " x dp %d%s | run dir %s",
        run.world_size,
        run.cluster.kind,
        run.device.type,
        run.backend if dist.is_initialized() else "no process group",
        mesh_text(run.mesh),
        c.data.global_batch,
        f" (data.global_batch unset: {run._batch_source})" if run._batch_source else "",
        c.data.micro_batch,
        run.accum,
        run.dp_size,
        # Each replica group is its own world: the global batch spans all of them.
        f" x {groups} replica groups" if groups > 1 else "",
        run.run_dir,
    )
    if run._default_run_dir:  # a directory appears in the cwd: say where and how to move it
        run.log.info(
            "job.run_dir unset: this run writes its config, logs, metrics and checkpoints "
            "to %s (in %s); set --job.run_dir=DIR to change it",
            run.run_dir,
            Path.cwd(),
        )


def init(
    config: Config | str | Path | None = None,
    argv: Sequence[str] | None = None,
    *,
    keep_argv: bool = False,
) -> Run:
    """Start meshrun in this process.

    Config: ``config`` (a Config or a TOML path), else the file named by ``MESHRUN_CONFIG``
    (set by ``meshrun launch``), else the defaults; then ``--section.key=value`` overrides from
    ``argv`` (default ``sys.argv[1:]``; other arguments are left for the script's own parser).
    Overrides taken from ``sys.argv`` are removed from it, so the script's own parser, called
    after ``init()``, sees only its own arguments; ``keep_argv=True`` leaves ``sys.argv`` as
    it was.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("meshrun.init() was already called in this process; use that Run")
    cfg = resolve_config(config, argv, keep_argv)
    run = Run(cfg, detect())
    _ACTIVE = run
    _install_excepthook()
    atexit.register(_close_at_exit)
    return run


def _install_excepthook() -> None:
    previous = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        global _FAILED
        _FAILED = True
        report_uncaught(tp, value, tb, previous)  # a lost Gloo peer: one line, not a traceback

    sys.excepthook = hook


def _close_at_exit() -> None:
    close_active_run(failed=_FAILED)


def close_active_run(failed: bool = False) -> None:
    """Close the run started by :func:`init`, if any (atexit and ``meshrun.main`` call it)."""
    if _ACTIVE is not None:
        _ACTIVE.close(failed=failed)
