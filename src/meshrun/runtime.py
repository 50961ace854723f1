"""``meshrun.init()``: detect the launcher, start the process group, build the mesh, seed, log,
and tear down cleanly. The returned :class:`Run` holds the runtime; each technique it offers is
a plain function elsewhere (``parallel``, ``data``, ``schedule``, ``loop``)."""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.utils.data import DataLoader, Dataset

from meshrun.agreement import StepAgreement
from meshrun.checkpoint import Checkpointer, Stateful
from meshrun.cluster import ClusterEnv, detect
from meshrun.config import (
    Config,
    ConfigError,
    grad_accumulation,
    validate_for_world,
    write_config,
)
from meshrun.data import ResumableSampler, build_dataloader
from meshrun.logs import init_logging
from meshrun.mesh import ParallelDims
from meshrun.monitor.mfu import ModelFlops, constant_per_token, model_flops, start_mfu
from meshrun.parallel import (
    Pipeline,
    build_grad_scaler,
    build_optimizer,
    check_optimizer,
    maybe_loss_parallel,
    parallelize,
    parallelize_pipeline,
    pipeline_eval,
    pipeline_step,
)
from meshrun.schedule import build_lr_scheduler, scale_lr
from meshrun.startup import (
    build_loop,
    build_metrics,
    checkpoint_facts,
    init_seeds,
    mesh_text,
    resolve_batch,
    resolve_config,
    start_process,
)
from meshrun.state import TrainState
from meshrun.storage import check_shared_run_dir

_ACTIVE: Run | None = None
_RETIRED: list[Run] = []  # closed runs, never destroyed before exit (see Run.close)
_FAILED = False  # set by our excepthook: an uncaught exception must skip the final barrier


class Run:
    """The runtime of one training process. Create it with :func:`init`."""

    def __init__(self, cfg: Config, env: ClusterEnv) -> None:
        self.config = cfg
        self.cluster = env
        self.rank, self.world_size, self.local_rank = env.rank, env.world_size, env.local_rank
        # First, before any effect: every value check (also of attributes set after the
        # Config was built), the mesh dims and every world-size check, as the launcher did.
        self.dims = ParallelDims(**validate_for_world(cfg, env.world_size))
        # Without a launcher's resolved config an unset global batch is the resumed
        # checkpoint's, else derived from this world; from here on everything (loop, sampler,
        # checkpoints, LR) sees the number.
        self._batch_source = resolve_batch(cfg, env.world_size)
        self._default_run_dir = not cfg.job.run_dir
        self.device, self.backend, self.mesh = start_process(cfg, env, self.dims)
        self.dp_size = self.dims.dp
        self.dp_rank = self.dims.dp_rank(self.rank)
        self.accum = grad_accumulation(cfg.data, self.dp_size)
        self.is_main = self.rank == 0
        self.run_dir = cfg.resolved_run_dir()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        check_shared_run_dir(self.run_dir, env.hostname)  # before anything relies on it
        self.log = init_logging(self.rank, self.run_dir, cfg.job.log_level)
        init_seeds(cfg.job.seed, self.rank)
        self.metrics = build_metrics(cfg, self.run_dir, self.is_main, self.world_size)
        # What is trained and where it is: the loop advances it, checkpoints save it.
        self.state = TrainState()
        # The one per-step collective: the loop exchanges it, the checkpoints read it.
        agreement = StepAgreement(self.device)
        self.loop = build_loop(
            cfg, self.accum, self.device, self.mesh, self.metrics, self.state, agreement
        )
        facts = checkpoint_facts(cfg, self.run_dir, self.accum, self.device)
        self.checkpointer = Checkpointer(cfg.checkpoint, facts, self.state, self.metrics, agreement)
        self._closed = False
        if self.is_main:
            write_config(cfg, self.run_dir / "config.toml")
            _announce(self)
        # One line per process start: `meshrun report` reads the world size, the batch
        # arithmetic and the restarts (a second start in the same file) from it.
        self.metrics.log_event(
            "start",
            world_size=self.world_size,
            dp=self.dp_size,
            global_batch=cfg.data.global_batch,
            micro_batch=cfg.data.micro_batch,
            accum=self.accum,
            device=self.device.type,
            host=self.cluster.hostname,
        )

    # --- techniques (each a plain function; Run only passes its state) -------------------

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
        ``run.backward``; the optimizer takes ``pipe.parameters()``. See parallel/pp.py.
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
        loss = pipeline_step(pipe, inputs, targets) * self.accum
        self.loop.record_loss(loss)
        return loss

    def pipeline_eval(
        self, pipe: Pipeline, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """Forward only (evaluation): this micro-batch's mean loss on every rank of the
        pipeline, not counted in the training metrics (see parallel/pp.py ``pipeline_eval``)."""
        return pipeline_eval(pipe, inputs, targets) * self.accum  # loss_fn carries 1/accum

    def optimizer(
        self,
        model: nn.Module | Pipeline,
        optimizer_class: type[torch.optim.Optimizer],
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        """``optimizer_class(model.parameters(), **kwargs)``; under ``parallel.zero = 1`` its
        state is sharded over the data-parallel ranks (a ZeroRedundancyOptimizer)."""
        return build_optimizer(model, optimizer_class, self.mesh, self.config.parallel, **kwargs)

    def scaled_lr(self, base_lr: float | None = None) -> float:
        """``base_lr`` (default ``optim.lr``) scaled by ``optim.lr_scaling`` to the global batch."""
        o = self.config.optim
        base = o.lr if base_lr is None else base_lr
        lr = scale_lr(base, self.config.data.global_batch, o.ref_batch, o.lr_scaling)
        if lr != base and self.is_main:
            self.log.info(
                "lr %.3g -> %.3g (%s scaling, global batch %d vs reference %d)",
                base,
                lr,
                o.lr_scaling,
                self.config.data.global_batch,
                o.ref_batch,
            )
        return lr

    def lr_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """Warmup + decay from ``[optim]``; stepped by :meth:`optimizer_step`."""
        sched = build_lr_scheduler(optimizer, self.config.optim)
        self.state.schedulers.append(sched)
        return sched

    def sampler(
        self, dataset_len: int, *, mode: Literal["train", "eval"] = "train"
    ) -> ResumableSampler:
        return ResumableSampler(
            dataset_len,
            rank=self.dp_rank,
            world_size=self.dp_size,
            global_batch=self.config.data.global_batch,
            seed=self.config.job.seed,
            shuffle=self.config.data.shuffle if mode == "train" else False,
            mode=mode,
        )

    def dataloader(
        self,
        dataset: Dataset[Any],
        micro_batch: int | None = None,
        *,
        mode: Literal["train", "eval"] = "train",
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> DataLoader[Any]:
        """A DataLoader over this rank's share, in a world-size-independent resumable order."""
        mb = self.config.data.micro_batch if micro_batch is None else micro_batch
        if mode == "train" and mb != self.config.data.micro_batch:
            raise ConfigError(
                f"run.dataloader(micro_batch={mb}) differs from data.micro_batch = "
                f"{self.config.data.micro_batch}; set --data.micro_batch={mb} instead so the "
                "accumulation is derived from it"
            )
        return build_dataloader(
            dataset,
            self.sampler(len(dataset), mode=mode),  # type: ignore[arg-type]
            mb,
            num_workers=self.config.data.num_workers,
            seed=self.config.job.seed,
            rank=self.rank,
            collate_fn=collate_fn,
            pin_memory=self.device.type == "cuda",
        )

    # --- the loop ------------------------------------------------------------------------

    def steps(
        self, loader: Iterable[Any], steps: int | None = None, tokens_per_sample: int | None = None
    ) -> Iterator[Any]:
        """Micro-batches on the device until ``optim.steps`` optimizer steps (see loop.py)."""
        if tokens_per_sample is None:  # 0 in the config: not known
            tokens_per_sample = self.config.metrics.tokens_per_sample or None
        return self.loop.steps(loader, steps, tokens_per_sample)

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

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss / accumulation).backward()``; see loop.py for why this is the right scale.
        Under ``parallel.loss_parallel`` the backward runs inside ``loss_parallel()`` too."""
        with maybe_loss_parallel(self.config.parallel):
            self.loop.backward(loss)

    def loss_parallel(self) -> AbstractContextManager[None]:
        """Compute the loss inside this (``with run.loss_parallel(): loss = ...``): with
        ``parallel.loss_parallel`` the logits are sharded over the vocabulary and cross-entropy
        must run under ``torch.distributed.tensor.parallel.loss_parallel()``; else a no-op."""
        return maybe_loss_parallel(self.config.parallel)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        check_optimizer(optimizer, self.config.parallel, self.dp_size)
        self.checkpointer.before_update()  # an async save's background copy must end first
        stepped = self.loop.optimizer_step(optimizer)
        if stepped:  # every `checkpoint.interval` steps, at the step boundary
            if self.state.optimizer is None:  # interval saves work without run.resume
                self.state.optimizer = optimizer
            # The watchdog allows a save more than a step (the phase), not the agreement on
            # whether to save, which runs every step.
            self.checkpointer.maybe_save(self.step, phase=lambda: self.phase("checkpoint"))
        return stepped

    def phase(self, name: str, timeout_s: float | None = None) -> AbstractContextManager[None]:
        """``with run.phase("eval"):`` gives the block the hang watchdog's longer limit
        (``timeout_s``, default ``monitor.phase_timeout_s``) instead of the step timeout."""
        return self.loop.monitor.phase(name, timeout_s)

    # --- checkpoints (see checkpoint/) ----------------------------------------------------

    def resume(
        self,
        model: nn.Module | Pipeline,
        optimizer: torch.optim.Optimizer,
        loader: Any = None,
        **named: Stateful,
    ) -> int:
        """Register what is checkpointed (model, optimizer, the loader's data position, user
        objects by name; schedulers from :meth:`lr_scheduler` are included) and load the
        checkpoint chosen by ``checkpoint.resume``. Returns the step resumed at (0 = fresh)."""
        if self.state.scaler is not None and "grad_scaler" not in named:
            scaler = cast(Stateful, self.state.scaler)  # its scale must survive restarts
            named = {**named, "grad_scaler": scaler}
        self.checkpointer.register(model, optimizer, loader, named)
        step = self.checkpointer.resume()
        if step:
            self.metrics.log_event("resume", from_step=step)  # later steps are redone
        return step

    def save_checkpoint(self) -> Path:
        """Checkpoint the current step now (collective: call on every rank)."""
        with self.phase("checkpoint"):
            return self.checkpointer.save()

    @property
    def step(self) -> int:
        """Optimizer steps done so far."""
        return self.state.step

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (e.g. eval loss sums and counts, once at the end)."""
        if self.mesh is not None:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.mesh.get_group("dp"))
        return value

    # --- teardown ------------------------------------------------------------------------

    def close(self, failed: bool = False) -> None:
        """Final summary, barrier (on success) and ``destroy_process_group``; idempotent."""
        global _ACTIVE
        if self._closed:
            return
        self._closed = True
        self.loop.monitor.loop_ends()
        if not failed:
            self.checkpointer.wait()  # an async checkpoint still being written is committed
        self.metrics.close()
        if dist.is_initialized():
            if not failed:
                # A barrier after a failure would wait for ranks that may never arrive.
                dist.barrier()
            dist.destroy_process_group()
        for h in logging.getLogger("meshrun").handlers:
            h.flush()
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


def _announce(run: Run) -> None:
    c = run.config
    run.log.info(
        "%d process(es) [%s] on %s + %s | mesh %s | global batch %d%s = micro %d x accum %d"
        " x dp %d | run dir %s",
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
        run.run_dir,
    )
    if run._default_run_dir:  # a directory appears in the cwd: say where and how to move it
        run.log.info(
            "job.run_dir unset: this run writes its config, logs, metrics and checkpoints "
            "to %s (in %s); set --job.run_dir=DIR to change it",
            run.run_dir,
            Path.cwd(),
        )


def init(config: Config | str | Path | None = None, argv: Sequence[str] | None = None) -> Run:
    """Start meshrun in this process.

    Config: ``config`` (a Config or a TOML path), else the file named by ``MESHRUN_CONFIG``
    (set by ``meshrun launch``), else the defaults; then ``--section.key=value`` overrides from
    ``argv`` (default ``sys.argv[1:]``; other arguments are left for the script's own parser).
    """
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("meshrun.init() was already called in this process; use that Run")
    cfg = resolve_config(config, argv)
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
        previous(tp, value, tb)

    sys.excepthook = hook


def _close_at_exit() -> None:
    close_active_run(failed=_FAILED)


def close_active_run(failed: bool = False) -> None:
    """Close the run started by :func:`init`, if any (atexit and ``meshrun.main`` call it)."""
    if _ACTIVE is not None:
        _ACTIVE.close(failed=failed)
