"""The node-local checkpoint tier: every ``checkpoint.local_interval`` steps each rank writes its
own shard of the state to its node's ``checkpoint.local_dir`` (RAM disk or local NVMe) and sends
a copy to one rank on the next node, which keeps it in its own local dir. A restart (same
world, same config) restores from these when they are newer than the shared checkpoint: a rank
whose node lost its shard (a replaced node) receives it from the node that kept the replica.
The shared checkpoint (``checkpoint.interval``) stays the durable one: losing a node *and* the
node that keeps its replicas leaves only it. See docs/checkpoint.md.

Which ranks hold what is agreed in one collective (an all-gather of each rank's list of shard
files), not assumed from the peer mapping: torchrun numbers nodes by sorting their addresses at
each rendezvous, so a replaced node can move ranks to other hosts on a restart.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshrun.checkpoint import on_disk
from meshrun.checkpoint.checks import CheckpointError
from meshrun.checkpoint.facts import RunFacts, any_rank
from meshrun.checkpoint.local.files import (
    decode,
    encode,
    private_dir,
    remove_steps,
    scan,
    write_atomically,
)
from meshrun.checkpoint.local.p2p import transfer
from meshrun.checkpoint.local.restore import collect_shard, load_shard
from meshrun.checkpoint.local.rules import (
    Choice,
    Held,
    choose_step,
    history_name,
    node_of,
    parse_history,
    replica_peer,
    replica_source,
    shard_name,
    stale_steps,
    step_name,
    superseded,
)
from meshrun.checkpoint.targets import Targets
from meshrun.config import CheckpointConfig
from meshrun.monitor import MetricsLogger
from meshrun.runtime.launcher_env import detect

__all__ = ["LocalTier", "default_local_dir"]

log = logging.getLogger("meshrun")


def default_local_dir(root: Path) -> Path:
    """``/dev/shm/meshrun-<uid>/<hash of the checkpoint dir>``: RAM, per user and per run (the
    system temp dir where there is no writable /dev/shm)."""
    base = Path("/dev/shm")
    if not (base.is_dir() and os.access(base, os.W_OK)):
        base = Path(tempfile.gettempdir())
    key = hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:12]
    return base / f"meshrun-{os.getuid()}" / key


def _node_dir(local_dir: str, node: int, root: Path) -> Path:
    """This node's snapshot directory, private to the user (checked, else CheckpointError)."""
    if local_dir:
        path = Path(local_dir.format(node=node))
        private_dir(path, "checkpoint.local_dir")
        return path
    path = default_local_dir(root)
    private_dir(path.parent, "the node-local snapshots' directory")  # /dev/shm/meshrun-<uid>
    private_dir(path, "the node-local snapshots' directory")
    return path


class LocalTier:
    """Snapshots and restores one rank's shard; every method is collective."""

    def __init__(
        self, cfg: CheckpointConfig, facts: RunFacts, targets: Targets, metrics: MetricsLogger
    ) -> None:
        self.cfg, self.facts, self.targets, self.metrics = cfg, facts, targets, metrics
        per_node = cfg.local_ranks_per_node or detect(dict(os.environ)).local_world_size
        if per_node < 1 or facts.world % per_node:
            raise CheckpointError(
                f"checkpoint.local_ranks_per_node = {per_node} does not divide the world size "
                f"{facts.world}: set --checkpoint.local_ranks_per_node to the ranks of one node"
            )
        self.per_node = per_node
        node = node_of(facts.rank, per_node)
        self.node_dir = _node_dir(cfg.local_dir, node, facts.root)
        self.history = history_name(facts.world, facts.config_digest)
        self.peer = replica_peer(facts.rank, facts.world, per_node)
        self.source = replica_source(facts.rank, facts.world, per_node)
        self.leader = facts.rank % per_node == 0  # one rank per node prunes its directory
        if facts.rank == 0:
            log.info("%s", self._describe())

    def _describe(self) -> str:
        head = f"node-local checkpoints every {self.cfg.local_interval} steps in {self.node_dir}"
        if self.peer is None:
            return (
                f"{head}, not replicated (one node: a peer on the same node is lost with it); "
                "a restart of this node's processes restores from them"
            )
        return f"{head}, each rank's shard also kept by rank + {self.per_node} (the next node)"

    def _path(self, step: int, shard: int) -> Path:
        return self.node_dir / self.history / step_name(step) / shard_name(shard)

    # --- snapshot --------------------------------------------------------------------------

    def snapshot(self, step: int) -> None:
        """Write this rank's shard of ``step`` and keep the replica of its source's."""
        t0 = time.perf_counter()
        data, error = b"", None
        try:
            tensors, meta = collect_shard(self.targets, step)
            data = encode(tensors, meta)
            write_atomically(self._path(step, self.facts.rank), data)
        except Exception as e:  # agreed below: every rank stops or trains on alike
            error = e
        # Every rank takes part in the exchange even when its own write failed (a rank
        # missing from it would leave its peer waiting).
        sends = {self.peer: data} if self.peer is not None else {}
        got = transfer(sends, [] if self.source is None else [self.source], self.facts.device)
        try:
            if self.source is not None and got.get(self.source):
                write_atomically(self._path(step, self.source), got[self.source])
        except Exception as e:
            error = error or e
        self._agree_written(step, error)
        if self.leader:
            hist = self.node_dir / self.history
            remove_steps(
                hist,
                stale_steps(
                    (h.step for h in scan(self.node_dir) if h.history == self.history), step
                ),
            )
        blocked = time.perf_counter() - t0
        self.metrics.log_event(
            "checkpoint", after_step=step, blocked_s=blocked, tier="local", bytes=len(data)
        )

    def _agree_written(self, step: int, error: BaseException | None) -> None:
        if not any_rank(error is not None, self.facts.device):
            return
        where = f"rank {self.facts.rank}: {error}" if error else "another rank failed (see its log)"
        msg = (
            f"node-local snapshot of step {step} failed ({where}); the previous snapshots and the "
            f"shared checkpoints are intact; free space in {self.node_dir} or set "
            "checkpoint.local_dir (checkpoint.local_interval = 0 turns the tier off)"
        )
        if self.cfg.on_error == "stop":
            raise CheckpointError(msg) from error
        log.error("%s; training goes on (checkpoint.on_error = 'warn')", msg)

    # --- restore ---------------------------------------------------------------------------

    def resume(self, shared: Callable[[], int | None]) -> int | None:
        """Restore from the node-local tier when it has a newer complete step than the shared
        checkpoint, else through ``shared`` (the shared path); returns the step (None: fresh)."""
        t0 = time.perf_counter()
        if self.cfg.resume != "auto":
            choice = Choice(None, f"checkpoint.resume = {self.cfg.resume!r}")
        else:
            choice = self._agree_step()
        step = self._restore(choice) if choice.step is not None else None
        if step is None:
            step = shared()
            self._say_shared(step, choice, time.perf_counter() - t0)
        if self.leader:  # snapshots after the resumed step belong to steps now redone
            hist = self.node_dir / self.history
            remove_steps(
                hist,
                superseded(
                    (h.step for h in scan(self.node_dir) if h.history == self.history), step or 0
                ),
            )
            self._remove_other_histories()
        return step

    def _agree_step(self) -> Choice:
        """The one collective: every rank's shard files, and rank 0's newest shared step."""
        f = self.facts
        mine = [(h.history, h.step, h.shard) for h in scan(self.node_dir)]
        shared = None
        if f.rank == 0:  # names only: validating the shared checkpoint is the shared path's
            listed = on_disk.list_checkpoints(f.root)
            shared = listed[-1].step if listed else None
        every: list[Any] = [(mine, shared)]
        if dist.is_initialized():
            every = [None] * f.world
            dist.all_gather_object(every, (mine, shared))
        seen = [[Held(*h) for h in held] for held, _ in every]
        return choose_step(seen, f.world, self.history, every[0][1])

    def _restore(self, choice: Choice) -> int | None:
        """Fetch the shards a node lost from the ranks that hold them, load every rank's; None
        (on every rank) when any rank failed, so all take the shared path together."""
        assert choice.step is not None
        t0, f, step = time.perf_counter(), self.facts, choice.step
        mine, error = None, None
        try:
            sends = {
                r: self._path(step, r).read_bytes()
                for r, src in choice.sources.items()
                if src == f.rank and r != f.rank
            }
            src = choice.sources[f.rank]
            got = transfer(sends, [src] if src != f.rank else [], f.device)
            own = self._path(step, f.rank)
            if src != f.rank:  # this node has its shard again
                write_atomically(own, got[src])
            tensors, meta = decode(own)
            mine = load_shard(self.targets, tensors, meta, str(own))
        except Exception as e:  # a torn or unreadable file, a layout that differs
            error = e
        if any_rank(error is not None, f.device):
            if error is not None:
                log.warning(
                    "node-local snapshot of step %d not restored on rank %d: %s",
                    step,
                    f.rank,
                    error,
                )
            if f.rank == 0:
                log.warning(
                    "node-local tier: step %d could not be restored; taking the shared path", step
                )
            return None
        self._say_local(choice, time.perf_counter() - t0)
        return mine

    def _say_local(self, choice: Choice, took: float) -> None:
        fetched = choice.fetched()
        via = (
            f"{len(fetched)} rank(s) {fetched} from a peer's replica"
            if fetched
            else "every rank from its own node"
        )
        if self.facts.rank == 0:
            log.info(
                "restored from the node-local tier: step %s (%s) in %.2f s", choice.step, via, took
            )
        self.metrics.log_event(
            "restore", tier="local", step=choice.step, fetched=fetched, seconds=took
        )

    def _say_shared(self, step: int | None, choice: Choice, took: float) -> None:
        if step is None:
            if self.facts.rank == 0 and choice.reason != "no node-local snapshot found":
                log.info("node-local tier not used: %s", choice.reason)
            return
        if self.facts.rank == 0:
            log.info(
                "restored from the shared checkpoint: step %d in %.2f s (node-local tier not used: %s)",
                step,
                took,
                choice.reason,
            )
        self.metrics.log_event(
            "restore", tier="shared", step=step, seconds=took, reason=choice.reason
        )

    def finish(self) -> None:
        """The run ended well: its snapshots are removed (in /dev/shm they hold RAM), unless
        ``checkpoint.local_keep``. Every rank's writes ended in the last snapshot's
        collective, so one rank per node removes them without waiting for the others."""
        if self.cfg.local_keep or not self.leader:
            return
        shutil.rmtree(self.node_dir / self.history, ignore_errors=True)
        if not self.cfg.local_dir:  # the default directory is this run's alone
            with contextlib.suppress(OSError):
                self.node_dir.rmdir()  # only when empty
        if self.facts.rank == 0:
            log.info("node-local snapshots removed (checkpoint.local_keep = true keeps them)")

    def _remove_other_histories(self) -> None:
        """Snapshots of another world size or config on this node can never be restored by this
        run (nor after it: it writes its own); they only hold memory."""
        for d in self.node_dir.iterdir() if self.node_dir.is_dir() else []:
            if parse_history(d.name) is not None and d.name != self.history:
                shutil.rmtree(d, ignore_errors=True)
