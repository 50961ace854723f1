"""Async interval saves (``checkpoint.async = true``): stage to CPU memory, write in the
background, commit at a later step boundary.

The state is copied to CPU memory in the stager's thread while training goes on to the next
forward and backward; :meth:`AsyncSaves.before_update` waits for the copy before the optimizer
changes anything. DCP's writer thread then writes the shards; once every rank's write is done
(:meth:`AsyncSaves.writing_locally` false on each, agreed by all) the save is committed with the
same protocol as a blocking one (commit.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from meshrun.checkpoint import on_disk
from meshrun.checkpoint.checks import first_cause
from meshrun.checkpoint.commit import Commit
from meshrun.checkpoint.facts import any_rank
from meshrun.parallel.kinds import is_dtensor

# DCP (with DTensor: about a second of CPU) is imported at the first save, not at start-up.
if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import DefaultStager

    from meshrun.checkpoint.writer import HashingFileSystem

__all__ = ["AsyncSaves"]

log = logging.getLogger("meshrun")


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


class AsyncSaves:
    """At most one async save in flight; ``commit`` finishes it (collective)."""

    def __init__(self, commit: Commit, device: torch.device, enabled: bool) -> None:
        self.commit = commit
        self.device = device
        self.pending: _Pending | None = None
        self._group: dist.ProcessGroup | None = None
        self._staging: DefaultStager | None = None
        if enabled and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # now, not in the first save

    def start(
        self,
        step: int,
        collect: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
        layout_name: str,
        digests: Callable[[], Mapping[str, int]] = dict,
    ) -> float | None:
        """Start writing the state ``collect()`` returns (its tensors cloned where they may
        change: :func:`clone_volatile`) into ``step``'s tmp dir; returns the seconds training
        was blocked, None when the start failed (then :meth:`Commit.finish` has raised).
        ``digests()``: the replicated objects' digests as of that ``collect()``, checked by
        :meth:`Commit.prepare`."""
        import torch.distributed.checkpoint as dcp  # imported before the clock starts
        from torch.distributed.checkpoint.api import CheckpointException as DCPException
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

        from meshrun.checkpoint.writer import hashing_writer

        if self._group is None and dist.is_initialized():
            # DCP's writer thread runs collectives: on a group of their own they cannot
            # interleave with the training's collectives on the default group.
            self._group = dist.new_group(backend="gloo")
        t0 = time.perf_counter()
        tmp = on_disk.tmp_dir(self.commit.root, step)
        tensors, plain = collect()
        self.commit.prepare(tmp, digests())
        pending = _Pending(step, tmp, plain, t0)
        try:
            self.commit.write_rank_file(tmp, plain)
            writer, fs = hashing_writer(tmp)
            pending.fs = fs
            response = dcp.async_save(
                tensors,
                storage_writer=writer,
                process_group=self._group,
                async_stager=self._stager(),
            )
        except (Exception, DCPException) as e:
            self.commit.finish(step, tmp, plain, {}, first_cause(e), layout_name)  # raises
            return None
        if isinstance(response, AsyncSaveResponse):
            pending.staged, future = response.staging_completion, response.upload_completion
        else:
            future = response  # staged synchronously (a stager without a thread)
        pending.blocked_s = time.perf_counter() - t0
        self.pending = pending
        future.add_done_callback(functools.partial(self._after_write, pending))
        return pending.blocked_s

    def before_update(self) -> None:
        """Wait for the background copy of the state, if one is running (see the module)."""
        p = self.pending
        if p is None or p.staged is None or p.staged.done():
            return
        t0 = time.perf_counter()
        with contextlib.suppress(Exception):  # a failed copy fails the write: reported at commit
            p.staged.result()
        p.blocked_s += time.perf_counter() - t0

    def _stager(self) -> DefaultStager:
        """One stager for the run: it keeps its CPU copy of every tensor between saves, so a
        save after the first copies into memory already mapped (the first one also allocates
        and page-faults it in). Pinned memory and non-blocking copies on CUDA only."""
        if self._staging is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

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
            pending.hashes = self.commit.my_digests(pending.tmp, pending.fs)
        except BaseException as e:
            pending.error = first_cause(e)
        pending.done.set()

    def writing_locally(self) -> bool:
        """Whether this rank's write of the save in flight is still running (no collective:
        the per-step agreement asks it, ``poll`` agrees on it by itself)."""
        return self.pending is not None and not self.pending.done.is_set()

    def poll(self, block: bool, layout_name: Callable[[], str]) -> int | None:
        """Commit the save in flight once every rank's write is done (one all-reduce while one
        is pending; with ``block`` wait for it first); returns the step committed."""
        p = self.pending
        if p is None:
            return None
        if block:
            p.done.wait()
        if dist.is_initialized():
            all_done = not any_rank(self.writing_locally(), self.device)
        else:
            all_done = not self.writing_locally()
        return self.commit_if(all_done, layout_name)

    def commit_if(self, all_done: bool, layout_name: Callable[[], str]) -> int | None:
        """Take the agreed answer (the same on every rank): commit when every write is done."""
        p = self.pending
        if p is None or not all_done:
            return None
        self.pending = None
        self.commit.finish(p.step, p.tmp, p.plain, p.hashes, p.error, layout_name())
        if self.commit.facts.rank == 0:
            log.info(
                "checkpoint %s (async): training blocked %.2f s, durable after %.2f s",
                on_disk.step_dir(self.commit.root, p.step),
                p.blocked_s,
                time.perf_counter() - p.t0,
            )
        return p.step


def clone_volatile(
    tensors: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Clone (now, on the training thread) every tensor that is neither a parameter nor
    optimizer state: buffers (BatchNorm statistics change in forward) and user objects may
    change before the next optimizer step, so only what changes in ``optimizer.step()``
    alone is left to the background copy."""
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


def _storage_ptr(t: torch.Tensor) -> int:
    local = t.to_local() if is_dtensor(t) else t  # FSDP2/TP: this rank's shard
    return int(local.untyped_storage().data_ptr())
