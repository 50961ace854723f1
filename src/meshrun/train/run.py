"""``meshrun.init()``: detect the launcher, start the process group, build the mesh, seed, log,
and tear down cleanly. The returned :class:`Run` holds the runtime; each technique it offers is
a plain function elsewhere (``parallel``, ``data``, ``schedule``, ``loop``), reached through
the method groups ``Run`` is made of (train/model.py, train/data.py, train/stepping.py)."""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import torch.distributed as dist

from meshrun.checkpoint import Checkpointer
from meshrun.config import Config, grad_accumulation, validate_for_world, write_config
from meshrun.runtime.agreement import StepAgreement
from meshrun.runtime.cluster import ClusterEnv, detect
from meshrun.runtime.logs import init_logging, report_uncaught
from meshrun.runtime.mesh import ParallelDims
from meshrun.runtime.runlock import release_rank0
from meshrun.runtime.state import TrainState
from meshrun.runtime.storage import check_shared_run_dir
from meshrun.train.data import DataMethods
from meshrun.train.evaluate import EvalMethods
from meshrun.train.model import ModelMethods
from meshrun.train.startup import (
    build_loop,
    build_metrics,
    checkpoint_facts,
    init_seeds,
    mesh_text,
    resolve_batch,
    resolve_config,
    start_process,
)
from meshrun.train.stepping import LoopMethods

_ACTIVE: Run | None = None
_RETIRED: list[Run] = []  # closed runs, never destroyed before exit (see Run.close)
_FAILED = False  # set by our excepthook: an uncaught exception must skip the final barrier


class Run(ModelMethods, DataMethods, LoopMethods, EvalMethods):
    """The runtime of one training process. Create it with :func:`init`.

    Its methods come in groups, each a small module: the model and its layout (train/model.py),
    data and learning rate (train/data.py), the step and checkpoints (train/stepping.py), the
    all-rank evaluation (train/evaluate.py). This class
    builds the state they share (train/base.py's fields) and tears it down."""

    def __init__(self, cfg: Config, env: ClusterEnv) -> None:
        self.config = cfg
        self.cluster = env
        self.rank, self.world_size, self.local_rank = env.rank, env.world_size, env.local_rank
        # First, before any effect: every value check (also of attributes set after the
        # Config was built), the mesh dims and every world-size check, as the launcher did.
        self.dims = ParallelDims(**validate_for_world(cfg, env.world_size), ep=cfg.parallel.ep)
        # Without a launcher's resolved config an unset global batch is the resumed
        # checkpoint's, else derived from this world; from here on everything (loop, sampler,
        # checkpoints, LR) sees the number.
        self._batch_source = resolve_batch(cfg, env.world_size)
        self._default_run_dir = not cfg.job.run_dir
        self.device, self.backend, self.mesh = start_process(cfg, env, self.dims)
        self.dp_size = self.dims.dp
        self.dp_rank = self.dims.dp_rank(self.rank)
        # Replica groups split the global batch over every group's data-parallel ranks.
        self.accum = grad_accumulation(cfg.data, self.dp_size, cfg.fault_tolerance.replica_groups)
        self.is_main = self.rank == 0
        self.run_dir = cfg.resolved_run_dir()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        check_shared_run_dir(self.run_dir, env.hostname)  # before anything relies on it
        self.log = init_logging(self.rank, self.run_dir, cfg.job.log_level, self.local_rank)
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
        if self.loop.diloco is not None:  # the synchronised weights, the outer optimizer
            self.checkpointer.register_internal("meshrun_diloco", self.loop.diloco)
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

    # --- teardown ------------------------------------------------------------------------

    def close(self, failed: bool = False) -> None:
        """Final summary, barrier (on success) and ``destroy_process_group``; idempotent."""
        global _ACTIVE
        if self._closed:
            return
        self._closed = True
        self.loop.monitor.loop_ends()
        if not failed:
            # An async checkpoint still being written is committed; node-local snapshots go.
            self.checkpointer.finish()
        self.metrics.close()
        if dist.is_initialized():
            if not failed:
                # A barrier after a failure would wait for ranks that may never arrive.
                dist.barrier()
            dist.destroy_process_group()
        release_rank0(self.run_dir)  # this job is over: the directory is free for the next
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
