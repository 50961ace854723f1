"""Save and resume the whole training state with ``torch.distributed.checkpoint``.

One :class:`Checkpointer` per run (``Run`` owns it). It tracks what defines the run: the model
and optimizer (through DCP's ``get_state_dict``/``set_state_dict``, so any layout works: DDP,
FSDP2, TP), the LR schedulers, the step counter, the sampler's data position, every rank's RNG
states, the resolved config and user objects registered by name. Tensors go to DCP (every rank
writes its part); everything else to JSON (see ``state.py``: nothing is unpickled on load).

Commit protocol: all ranks write into ``step_N.tmp``; all agree it worked; rank 0 writes the
manifest (sizes, SHA-256) and the COMPLETE marker, renames to ``step_N`` and applies retention;
all agree again. Any failure reaches every rank as a :class:`CheckpointError`, and the
previous checkpoint is untouched.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException as DCPException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.tensor import DTensor

from meshrun.checkpoint import layout
from meshrun.checkpoint.checks import (
    CheckpointError,
    check_keys,
    first_cause,
    layout_text,
    pick,
    reseed,
    space_text,
)
from meshrun.checkpoint.pipeline import PipelineView, gather_optim_plain, maybe_pipeline_view
from meshrun.checkpoint.state import (
    capture_rng,
    decode_json,
    merge_state,
    restore_rng,
    split_state,
)
from meshrun.checkpoint.writer import HashingFileSystem, hashing_writer
from meshrun.checkpoint.zero1 import (
    is_zero1,
    zero1_load,
    zero1_load_template,
    zero1_state_dict,
)
from meshrun.config import Config, to_toml
from meshrun.data.sampler import ResumableSampler
from meshrun.loop import StepLoop
from meshrun.schedule import scale_lr

__all__ = ["CheckpointError", "Checkpointer", "Stateful"]

log = logging.getLogger("meshrun")
STATE_FILE = "state.json"
_SAMPLER_AT_SAVE = "__sampler_at_save__"


class Stateful(Protocol):
    def state_dict(self) -> Mapping[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> Any: ...


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


@dataclass
class _Pending:
    """An async save in flight: DCP's thread writes it; it is committed at a step boundary."""

    step: int
    tmp: Path
    plain: dict[str, Any]
    t0: float
    blocked_s: float = 0.0
    hashes: dict[str, Any] = field(default_factory=dict)
    fs: HashingFileSystem | None = None
    staged: Future[None] | None = None  # the background copy of the state (async staging)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class Checkpointer:
    """Saves on a schedule and resumes; all methods are collective (call them on every rank)."""

    def __init__(self, cfg: Config, run_dir: Path, loop: StepLoop, device: torch.device) -> None:
        self.cfg = cfg
        self.root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
        self.loop = loop
        self.device = device
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.sampler: ResumableSampler | None = None
        self.named: dict[str, Stateful] = {}
        self.last_saved: int | None = None
        self._handlers_installed = False
        self._signal_name: str | None = None
        self._pending: _Pending | None = None
        self._async_group: dist.ProcessGroup | None = None
        self._staging: DefaultStager | None = None
        if cfg.checkpoint.async_ and dist.is_initialized():
            self._async_group = dist.new_group(backend="gloo")  # now, not in the first save

    # --- registration --------------------------------------------------------------------

    def register(
        self,
        model: Any,
        optimizer: torch.optim.Optimizer,
        loader: Any = None,
        named: Mapping[str, Stateful] | None = None,
    ) -> None:
        """``model``: the (parallelized) model, or the ``Pipeline`` from ``run.pipeline``."""
        self.model, self.optimizer = maybe_pipeline_view(model) or model, optimizer
        self.install_signal_handlers()
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, ResumableSampler):
            self.sampler = sampler
        elif loader is not None and hasattr(loader, "state_dict"):
            self.named["loader"] = loader  # e.g. torchdata's StatefulDataLoader
        elif loader is not None:
            raise CheckpointError(
                f"run.resume(..., loader={type(loader).__name__}): its position cannot be saved; "
                "build it with run.dataloader(dataset) (a ResumableSampler) or pass an object "
                "with state_dict()/load_state_dict()"
            )
        for name, obj in (named or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise CheckpointError(
                    f"run.resume(..., {name}=...): a {type(obj).__name__} has no "
                    "state_dict()/load_state_dict(); register only such objects"
                )
            self.named[name] = obj

    def note_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """``run.optimizer_step`` reports its optimizer, so interval saves work without resume."""
        if self.optimizer is None:
            self.optimizer = optimizer

    def _targets(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        if self.model is None and self.loop.pp_group is not None:  # run.pipeline's stages
            self.model = PipelineView(list(self.loop.models))
        elif self.model is None and len(self.loop.models) == 1:
            self.model = self.loop.models[0]
        if self.model is None or self.optimizer is None:
            raise CheckpointError(
                "nothing to checkpoint: call run.resume(model, optimizer, loader) before the "
                "loop (it registers what is saved), or run.parallelize(model) and "
                "run.optimizer_step(optimizer)"
            )
        loop_sampler = getattr(self.loop, "_sampler", None)  # set once run.steps() has begun
        if self.sampler is None and isinstance(loop_sampler, ResumableSampler):
            self.sampler = loop_sampler
        return self.model, self.optimizer

    # --- save ----------------------------------------------------------------------------

    def maybe_save(
        self, step: int, phase: Callable[[], AbstractContextManager[None]] = nullcontext
    ) -> Path | None:
        """Called after each optimizer step: save when ``checkpoint.interval`` divides ``step``
        or when any rank received a preemption signal (then exit 0 once saved). A save runs
        inside ``phase()`` (the hang watchdog's longer checkpoint limit); the per-step
        agreements before it do not: they are small collectives, and a rank stopped while its
        peers wait in one is a hang to report within ``monitor.step_timeout_s`` (inside the
        checkpoint phase it went unreported for ``monitor.phase_timeout_s``)."""
        interval = self.cfg.checkpoint.interval
        # Also without an interval: a preemption save (SLURM's USR1 before the time limit, a
        # SIGTERM) is the one checkpoint such a run gets, and the loop owns what is saved.
        self.install_signal_handlers()
        preempted = self._preempt_agreed()
        due = interval > 0 and step % interval == 0
        try:
            self._poll_pending(block=False)
            if not preempted and not due:
                return None
            with phase():
                if self.cfg.checkpoint.async_ and not preempted:
                    self.save_async(step)
                    return None
                path = self.save(step)
        except CheckpointError as e:
            if preempted or self.cfg.checkpoint.on_error == "stop":
                raise
            log.error("%s; training goes on (checkpoint.on_error = 'warn')", e)
            return None
        if preempted:
            if self.rank == 0:
                log.warning(
                    "preempted (%s): checkpoint %s written; exiting 0", self._signal_name, path
                )
            raise SystemExit(0)
        return path

    # --- preemption ----------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGUSR1 only set a flag; the ranks agree on it at the next step boundary
        (a handler must not save: it may run in the middle of a collective)."""
        if self._handlers_installed or not self.cfg.checkpoint.on_signal:
            return
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)
        self._handlers_installed = True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal_name = signal.Signals(signum).name

    def _preempt_agreed(self) -> bool:
        if not self._handlers_installed:
            return False
        flag = torch.tensor([int(self._signal_name is not None)], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one rank's signal stops them all
        if flag.item() and self._signal_name is None:
            self._signal_name = "a signal on another rank"
        return bool(flag.item())

    def save(self, step: int | None = None) -> Path:
        """Write a checkpoint of the current state at ``step`` (default: the loop's step)."""
        step = self.loop.step if step is None else step
        self.wait()  # an async save still in flight is committed first
        final, tmp = layout.step_dir(self.root, step), layout.tmp_dir(self.root, step)
        if self.last_saved == step and final.is_dir():
            return final
        t0 = time.perf_counter()
        tensors, plain = self._collect()
        self._prepare_tmp(tmp)
        error: BaseException | None = None
        mine: dict[str, Any] = {}
        try:
            self._write_rank_file(tmp)
            writer, fs = hashing_writer(tmp)
            dcp.save(tensors, storage_writer=writer)
            mine = self._my_digests(tmp, fs)
        except (Exception, DCPException) as e:  # DCP raises on every rank if any failed
            error = first_cause(e)
        self._finish(step, tmp, plain, mine, error)
        if self.rank == 0:
            log.info("checkpoint %s written in %.2f s", final, time.perf_counter() - t0)
        # Training was blocked this long (`meshrun report` counts it against goodput).
        blocked = time.perf_counter() - t0
        self.loop.metrics.log_event("checkpoint", after_step=step, blocked_s=blocked)
        return final

    def _write_rank_file(self, tmp: Path) -> None:
        layout.write_file_durably(tmp / rank_file(self.rank), json.dumps(capture_rng()).encode())

    def _finish(
        self,
        step: int,
        tmp: Path,
        plain: dict[str, Any],
        mine: dict[str, Any],
        error: BaseException | None,
    ) -> None:
        """All ranks agree the shards are written; rank 0 commits; all agree again."""
        self._agree(error, step, "writing its shards", tmp)
        hashed = self._gather_hashes(mine)
        if self.rank == 0:
            error = self._commit(tmp, layout.step_dir(self.root, step), step, plain, hashed)
        self._agree(error, step, "the commit on rank 0", tmp)
        self.last_saved = step

    # --- async save ----------------------------------------------------------------------

    def save_async(self, step: int | None = None) -> None:
        """Start an async save: the state is copied to CPU memory in the stager's thread
        (:meth:`before_update` waits for the copy before the next optimizer step), then DCP
        writes it from a background thread; committed at a later step boundary
        (``_poll_pending``)."""
        step = self.loop.step if step is None else step
        self.wait()  # at most one save in flight
        if self._async_group is None and dist.is_initialized():
            # DCP's writer thread runs collectives: on a group of their own they cannot
            # interleave with the training's collectives on the default group.
            self._async_group = dist.new_group(backend="gloo")
        t0 = time.perf_counter()
        tmp = layout.tmp_dir(self.root, step)
        tensors, plain = self._collect()
        tensors = self._clone_volatile(tensors)
        self._prepare_tmp(tmp)
        pending = _Pending(step, tmp, plain, t0)
        try:
            self._write_rank_file(tmp)
            writer, fs = hashing_writer(tmp)
            pending.fs = fs
            response = dcp.async_save(
                tensors,
                storage_writer=writer,
                process_group=self._async_group,
                async_stager=self._stager(),
            )
        except (Exception, DCPException) as e:
            self._finish(step, tmp, plain, {}, first_cause(e))  # raises on every rank
            return
        if isinstance(response, AsyncSaveResponse):
            pending.staged, future = response.staging_completion, response.upload_completion
        else:
            future = response  # staged synchronously (a stager without a thread)
        pending.blocked_s = time.perf_counter() - t0
        self.loop.metrics.log_event("checkpoint", after_step=step, blocked_s=pending.blocked_s)
        self._pending = pending
        future.add_done_callback(functools.partial(self._after_write, pending))

    def before_update(self) -> None:
        """``run.optimizer_step`` calls this before the optimizer changes anything: the copy of
        the parameters and optimizer state that an async save makes in the background must be
        finished by then. The wait (usually none: the copy overlaps the forward and backward)
        counts as time training was blocked."""
        p = self._pending
        if p is None or p.staged is None or p.staged.done():
            return
        t0 = time.perf_counter()
        with contextlib.suppress(Exception):  # a failed copy fails the write: reported at commit
            p.staged.result()
        p.blocked_s += time.perf_counter() - t0

    def _clone_volatile(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Clone (now, on the training thread) every tensor that is neither a parameter nor
        optimizer state: buffers (BatchNorm statistics change in forward) and user objects may
        change before the next optimizer step, so only what changes in ``optimizer.step()``
        alone is left to the background copy."""
        model, optimizer = self._targets()
        inner = getattr(optimizer, "optim", optimizer)  # ZeRO-1 keeps the state in .optim
        stable = {_storage_ptr(p) for p in model.parameters()}
        stable |= {
            _storage_ptr(v)
            for st in inner.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        }

        def walk(node: Any) -> Any:
            if isinstance(node, torch.Tensor):
                return node if _storage_ptr(node) in stable else node.detach().clone()
            return {k: walk(v) for k, v in node.items()} if isinstance(node, dict) else node

        return cast("dict[str, Any]", walk(tensors))

    def _stager(self) -> DefaultStager:
        """One stager for the run: it keeps its CPU copy of every tensor between saves, so a
        save after the first copies into memory already mapped (the first one also allocates
        and page-faults it in). The copy runs in the stager's thread while training goes on to
        the next forward and backward; :meth:`before_update` waits for it before the optimizer
        changes anything. Pinned memory and non-blocking copies on CUDA only."""
        if self._staging is None:
            cuda = self.device.type == "cuda"
            self._staging = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )
        return self._staging

    def _after_write(self, pending: _Pending, future: Any) -> None:
        """In DCP's writer thread: collect the digests of this rank's files."""
        try:
            future.result()
            assert pending.fs is not None
            pending.hashes = self._my_digests(pending.tmp, pending.fs)
        except BaseException as e:
            pending.error = first_cause(e)
        pending.done.set()

    def _poll_pending(self, block: bool) -> None:
        """Commit the save in flight once every rank's write is done (collective while one is
        pending; with ``block`` wait for it)."""
        p = self._pending
        if p is None:
            return
        if block:
            p.done.wait()
        if dist.is_initialized():
            flag = torch.tensor([int(not p.done.is_set())], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                return
        elif not p.done.is_set():
            return
        self._pending = None
        self._finish(p.step, p.tmp, p.plain, p.hashes, p.error)
        if self.rank == 0:
            log.info(
                "checkpoint %s (async): training blocked %.2f s, durable after %.2f s",
                layout.step_dir(self.root, p.step),
                p.blocked_s,
                time.perf_counter() - p.t0,
            )

    def wait(self) -> None:
        """Commit the async save in flight, if any (collective); ``run.close`` calls it."""
        self._poll_pending(block=True)

    def _collect(self) -> tuple[dict[str, Any], dict[str, Any]]:
        model, optimizer = self._targets()
        self._warn_unregistered(optimizer)
        user = {name: obj.state_dict() for name, obj in self.named.items()}
        if is_zero1(optimizer):  # each rank gives the optimizer state it owns (zero1.py)
            ot, op = zero1_state_dict(model, optimizer)
            tensors, plain = split_state({"model": get_model_state_dict(model), "user": user})
            tensors.update({"optim": ot} if ot else {})
            plain["optim"] = op
            if isinstance(model, PipelineView) and self.loop.pp_group is not None:
                plain["optim"] = gather_optim_plain(plain["optim"], self.loop.pp_group)
        else:
            msd, osd = get_state_dict(model, optimizer)
            tensors, plain = split_state({"model": msd, "optim": osd, "user": user})
            if isinstance(model, PipelineView) and self.loop.pp_group is not None:
                plain["optim"] = gather_optim_plain(plain["optim"], self.loop.pp_group)
        plain["schedulers"] = [s.state_dict() for s in self.loop.schedulers]
        # LambdaLR keeps its functions out of state_dict() (None here): nothing to pickle.
        tensors_only, sched_plain = split_state({"s": plain.pop("schedulers")})
        if tensors_only:
            raise CheckpointError("an LR scheduler's state_dict() holds tensors: not supported")
        plain["schedulers"] = sched_plain["s"]
        # The data position of *this* step: an async save is committed steps later, when the
        # sampler has moved on (a JSON round trip makes it a copy).
        sampler = self.sampler.state_dict() if self.sampler is not None else None
        plain[_SAMPLER_AT_SAVE] = json.loads(json.dumps(sampler))
        return tensors, plain

    def _warn_unregistered(self, optimizer: torch.optim.Optimizer) -> None:
        driven = hasattr(optimizer.step, "_wrapped_by_lr_sched")
        mine = any(s.optimizer is optimizer for s in self.loop.schedulers)
        if driven and not mine and self.rank == 0:
            log.warning(
                "an LR scheduler steps this optimizer but is not saved: create it with "
                "run.lr_scheduler(optimizer) (or pass it to run.resume(..., sched=scheduler))"
            )

    def _prepare_tmp(self, tmp: Path) -> None:
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
            tmp.mkdir(parents=True)
        _barrier()

    def _my_digests(self, tmp: Path, fs: HashingFileSystem) -> dict[str, Any]:
        """Size and SHA-256 of the files this rank wrote: its shards were hashed while DCP wrote
        them (no re-read); its small RNG file is hashed here. Each rank reports its own files, so
        rank 0 never reads the whole checkpoint."""
        mine = dict(fs.digests)
        stray = {p.name for p in tmp.glob(f"__{self.rank}_*.distcp")} - set(mine)
        if stray:  # DCP wrote a shard around the hashing seam: hash it the slow way
            log.warning("%s: shards %s were not hashed while written; re-reading", tmp, stray)
        mine.update(layout.hash_files(tmp, [*sorted(stray), rank_file(self.rank)]))
        return mine

    def _gather_hashes(self, mine: dict[str, Any]) -> dict[str, Any]:
        if not dist.is_initialized():
            return mine
        every: list[dict[str, Any] | None] = [None] * self.world
        dist.all_gather_object(every, mine)  # small dicts of names and hex digests
        return {k: v for part in every if part for k, v in part.items()}

    def _commit(
        self, tmp: Path, final: Path, step: int, plain: dict[str, Any], hashed: dict[str, Any]
    ) -> BaseException | None:
        try:
            layout.write_file_durably(
                tmp / STATE_FILE, json.dumps(self._global_state(step, plain)).encode()
            )
            manifest = layout.build_manifest(tmp, step=step, meta=self._meta(), known=hashed)
            if final.exists():  # an older save of the same step (e.g. before a restart)
                shutil.rmtree(final)
            layout.commit_dir(tmp, final, manifest)
            self._apply_retention(step)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)  # free the space; the previous one stays
            return e
        return None

    def _global_state(self, step: int, plain: dict[str, Any]) -> dict[str, Any]:
        return {
            "step": step,
            "sampler": plain[_SAMPLER_AT_SAVE],
            "plain": {k: v for k, v in plain.items() if k != _SAMPLER_AT_SAVE},
            "config_toml": to_toml(self.cfg),
        }

    def _meta(self) -> dict[str, Any]:
        d = self.cfg.data
        return {
            "world_size": self.world,
            "dp_size": self.loop_dp(),
            "accum": self.loop.accum,
            "global_batch": d.global_batch,
            "micro_batch": d.micro_batch,
            "layout": layout_text(self.model),
            "config_digest": self.cfg.digest(),
            "created_unix": time.time(),
        }

    def loop_dp(self) -> int:
        return self.loop.global_batch // (self.loop.micro_batch * self.loop.accum)

    def _apply_retention(self, newest: int) -> None:
        c = self.cfg.checkpoint
        found = {info.step: info.path for info in layout.list_checkpoints(self.root)}
        for step in layout.retention(
            found, keep_last=c.keep_last, keep_every=c.keep_every, newest_valid=newest
        ):
            shutil.rmtree(found[step], ignore_errors=True)

    def _agree(self, error: BaseException | None, step: int, what: str, tmp: Path) -> None:
        """Raise the same CheckpointError on every rank when any rank failed."""
        failed = error is not None
        space = space_text(tmp) if failed else ""  # before rank 0 frees the space
        if dist.is_initialized():
            flag = torch.tensor([int(failed)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            failed = bool(flag.item())
        if not failed:
            return
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the previous one stays
        where = (
            f"rank {self.rank}: {error}{space}"
            if error is not None
            else "another rank failed (see its log)"
        )
        previous = self.newest_valid_step(checksums=False)
        raise CheckpointError(
            f"checkpoint of step {step} failed in {what} ({where}); training state is intact and "
            f"the previous checkpoint ({'step ' + str(previous) if previous is not None else 'none'}) "
            f"is still valid; free space in {self.root} or set checkpoint.dir"
        ) from error

    # --- resume --------------------------------------------------------------------------

    def newest_valid_step(self, checksums: bool = True) -> int | None:
        for info in reversed(layout.list_checkpoints(self.root)):
            if not layout.problems(info.path, checksums=checksums):
                return info.step
        return None

    def choose(self, mode: str) -> Path | None:
        """The checkpoint to resume from (rank 0 validates, all ranks get its answer)."""
        answer: list[Any] = [None, None]
        if self.rank == 0:
            try:
                answer[0] = pick(self.root, mode)
            except CheckpointError as e:
                answer[1] = str(e)
        if dist.is_initialized():
            dist.broadcast_object_list(answer, src=0)
        if answer[1] is not None:
            raise CheckpointError(answer[1])
        return None if answer[0] is None else Path(answer[0])

    def resume(self) -> int:
        """Load the checkpoint chosen by ``checkpoint.resume``; return the step (0 = fresh)."""
        path = self.choose(self.cfg.checkpoint.resume)
        if path is None:
            if self.rank == 0 and self.cfg.checkpoint.resume == "auto":
                log.info("no valid checkpoint under %s: starting at step 0", self.root)
            return 0
        model, optimizer = self._targets()
        saved = json.loads((path / STATE_FILE).read_text())
        manifest = layout.read_manifest(path)
        lr_factor = self._check_batch(path, manifest)
        full = self._load_tensors(path, model, optimizer, saved["plain"])
        for name, obj in self.named.items():
            obj.load_state_dict(full["user"][name])
        self._restore_rest(path, saved, manifest)
        if lr_factor != 1.0:
            self._rescale_lr(optimizer, lr_factor)
        self.last_saved = saved["step"]
        return int(saved["step"])

    def _load_tensors(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        plain: dict[str, Any],
    ) -> dict[str, Any]:
        """Load model, optimizer and user tensors from ``path`` into this run's layout (DCP
        re-shards); returns the merged state (for the user objects)."""
        user = {name: obj.state_dict() for name, obj in self.named.items()}
        if not is_zero1(optimizer):
            msd, osd = get_state_dict(model, optimizer)
            tensors, _ = split_state({"model": msd, "optim": osd, "user": user})
            check_keys(path, tensors, known=self._other_stages_keys(model, tensors))
            dcp.load(tensors, checkpoint_id=str(path))
            full = merge_state(tensors, plain)
            set_state_dict(
                model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optim"]
            )
            return full
        # ZeRO-1: each rank loads the optimizer state of the parameters it owns now.
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        stage = isinstance(model, PipelineView)  # pp x ZeRO-1: this rank's stages only
        template, seen = zero1_load_template(model, optimizer, meta, partial=stage)
        tensors, _ = split_state({"model": get_model_state_dict(model), "user": user})
        check_keys(path, tensors, known=seen | self._other_stages_keys(model, tensors))
        dcp.load({**tensors, "optim": {"state": template}}, checkpoint_id=str(path))
        full = merge_state(tensors, plain)
        set_model_state_dict(model, full["model"])
        zero1_load(model, optimizer, template, plain["optim"], partial=stage)
        return full

    def _other_stages_keys(self, model: nn.Module, tensors: dict[str, Any]) -> set[str]:
        """Under pipeline parallelism each rank holds only its stages: the keys of the others
        (all-gathered) are known to this run, not extra."""
        if not isinstance(model, PipelineView) or not dist.is_initialized():
            return set()
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, sorted(flatten_state_dict(tensors)[0]))
        return {k for keys in every for k in keys}

    def _restore_rest(self, path: Path, saved: dict[str, Any], manifest: dict[str, Any]) -> None:
        scheds = decode_json(saved["plain"]["schedulers"])
        if len(scheds) != len(self.loop.schedulers):
            raise CheckpointError(
                f"{path.name} holds {len(scheds)} LR scheduler(s), this run has "
                f"{len(self.loop.schedulers)}: create the same schedulers (run.lr_scheduler) before run.resume"
            )
        for sched, sd in zip(self.loop.schedulers, scheds, strict=True):
            sched.load_state_dict(sd)
        if saved["sampler"] is not None and self.sampler is None:
            log.warning(
                "%s: the data position was not restored: pass the loader to run.resume(model, optimizer, loader)",
                path.name,
            )
        elif saved["sampler"] is not None and self.sampler is not None:
            self.sampler.load_state_dict(saved["sampler"])
        self.loop.step, self.loop.micro = int(saved["step"]), 0
        same_world = manifest["world_size"] == self.world
        if same_world:
            restore_rng(json.loads((path / rank_file(self.rank)).read_text()))
        else:
            reseed(self.cfg.job.seed, int(saved["step"]), self.rank)
        if self.rank == 0:
            log.info("%s", self._plan_text(path, saved, manifest, same_world))

    def _plan_text(
        self, path: Path, saved: dict[str, Any], m: dict[str, Any], same_world: bool
    ) -> str:
        pos = f"{saved['sampler']['consumed']} samples" if saved["sampler"] else "not saved"
        head = f"resumed from {path} (step {saved['step']}, data position {pos})"
        if same_world:
            return head
        return (
            f"{head}; resharding: saved on {m['world_size']} ranks (dp {m['dp_size']}, accum "
            f"{m['accum']}, {m['layout']}) -> {self.world} ranks (dp {self.loop_dp()}, accum "
            f"{self.loop.accum}, {layout_text(self.model)}); global batch {m['global_batch']} kept; "
            "model/optimizer tensors re-sharded by DCP; per-rank RNG streams re-seeded from "
            "(seed, step, rank) since ranks changed"
        )

    def _check_batch(self, path: Path, m: dict[str, Any]) -> float:
        """The LR factor for this run's global batch vs the checkpoint's (1.0 if equal)."""
        old, new = int(m["global_batch"]), self.cfg.data.global_batch
        if old == new:
            return 1.0
        rule = self.cfg.optim.lr_scaling
        if not self.cfg.checkpoint.allow_new_global_batch:
            raise CheckpointError(
                f"{path.name} was trained with data.global_batch = {old}, this run has {new}: "
                f"set --data.global_batch={old} to continue the same run (accumulation is "
                "re-derived for any number of ranks), or --checkpoint.allow_new_global_batch=true "
                f"to change it (the LR is then rescaled by optim.lr_scaling = {rule!r})"
            )
        factor = scale_lr(1.0, new, old, rule)
        if self.rank == 0:
            log.warning(
                "%s: global batch %d -> %d (checkpoint.allow_new_global_batch): LR x %.4g "
                "(optim.lr_scaling = %s); the data position carries over in samples",
                path.name,
                old,
                new,
                factor,
                rule,
            )
        return factor

    def _rescale_lr(self, optimizer: torch.optim.Optimizer, factor: float) -> None:
        # The restored LR (and the schedulers' base LRs, which later steps derive from) belong
        # to the old global batch; scale both so the schedule continues at the new batch's LR.
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] = group[key] * factor
        for sched in self.loop.schedulers:
            sched.base_lrs = [lr * factor for lr in sched.base_lrs]


def _storage_ptr(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t  # FSDP2/TP: this rank's shard
    return int(local.untyped_storage().data_ptr())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
