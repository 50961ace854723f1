"""The commit protocol of a checkpoint, its manifest and retention.

All ranks write into ``step_N.tmp`` (DCP shards and a per-rank file: the RNG states and the
per-rank objects); all agree it worked;
rank 0 writes ``state.json`` and the manifest (sizes, SHA-256 each rank reported for its own
files) with its COMPLETE marker, renames to ``step_N`` and applies retention; all agree again.
Any failure reaches every rank as the same :class:`CheckpointError`, and the previous
checkpoint is untouched.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from meshrun.checkpoint import on_disk
from meshrun.checkpoint.checks import CheckpointError, space_text
from meshrun.checkpoint.facts import RunFacts, any_rank
from meshrun.checkpoint.hf_files import HF_FILES
from meshrun.checkpoint.state import capture_rng
from meshrun.checkpoint.targets import PER_RANK, SAMPLER_AT_SAVE, agree_replicated
from meshrun.config import CheckpointConfig

if TYPE_CHECKING:  # the writer subclasses DCP's FileSystem: imported at the first save
    from meshrun.checkpoint.writer import HashingFileSystem

__all__ = ["STATE_FILE", "Commit", "rank_file"]

log = logging.getLogger("meshrun")
STATE_FILE = "state.json"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


class Commit:
    """Prepares a checkpoint's directory, then commits it on every rank alike (collective)."""

    def __init__(self, cfg: CheckpointConfig, facts: RunFacts) -> None:
        self.cfg = cfg
        self.facts = facts
        self.root = facts.root

    def prepare(self, tmp: Path, digests: Mapping[str, int] | None = None) -> None:
        """A fresh, empty ``tmp`` on every rank (one left by a save that was killed goes).
        ``digests``: the replicated objects' (``Targets.digests``), compared by the barrier
        every rank waits in for ``tmp`` (one collective either way); when they differ every
        rank raises the same :class:`CheckpointError` and ``tmp`` goes again."""
        if self.facts.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        try:
            agree_replicated(digests or {}, self.facts.device)
        except CheckpointError:
            if self.facts.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def write_rank_file(self, tmp: Path, plain: dict[str, Any]) -> None:
        """This rank's RNG states and its per-rank objects (``plain[PER_RANK]``), as JSON."""
        name = rank_file(self.facts.rank)
        mine = {**capture_rng(), "per_rank": plain.get(PER_RANK, {})}
        on_disk.write_file_durably(tmp / name, json.dumps(mine).encode())

    def my_digests(self, tmp: Path, fs: HashingFileSystem) -> dict[str, Any]:
        """Size and SHA-256 of the files this rank wrote: its shards were hashed while DCP wrote
        them (no re-read); its small RNG file is hashed here. Each rank reports its own files, so
        rank 0 never reads the whole checkpoint."""
        mine = dict(fs.digests)
        rank = self.facts.rank
        stray = {p.name for p in tmp.glob(f"__{rank}_*.distcp")} - set(mine)
        if stray:  # DCP wrote a shard around the hashing seam: hash it the slow way
            log.warning("%s: shards %s were not hashed while written; re-reading", tmp, stray)
        mine.update(on_disk.hash_files(tmp, [*sorted(stray), rank_file(rank)]))
        return mine

    def finish(
        self,
        step: int,
        tmp: Path,
        plain: dict[str, Any],
        mine: dict[str, Any],
        error: BaseException | None,
        layout_name: str,
    ) -> None:
        """All ranks agree the shards are written; rank 0 commits; all agree again."""
        self._agree(error, step, "writing its shards", tmp)
        hashed = self._gather_hashes(mine)
        if self.facts.rank == 0:
            final = on_disk.step_dir(self.root, step)
            error = self._commit(tmp, final, step, plain, hashed, layout_name)
        self._agree(error, step, "the commit on rank 0", tmp)

    def _gather_hashes(self, mine: dict[str, Any]) -> dict[str, Any]:
        if not dist.is_initialized():
            return mine
        every: list[dict[str, Any] | None] = [None] * self.facts.world
        dist.all_gather_object(every, mine)  # small dicts of names and hex digests
        return {k: v for part in every if part for k, v in part.items()}

    def _commit(
        self,
        tmp: Path,
        final: Path,
        step: int,
        plain: dict[str, Any],
        hashed: dict[str, Any],
        layout_name: str,
    ) -> BaseException | None:
        try:
            on_disk.write_file_durably(
                tmp / STATE_FILE, json.dumps(self._global_state(step, plain)).encode()
            )
            for name, text in plain.get(HF_FILES, {}).items():  # listed in the manifest too
                on_disk.write_file_durably(tmp / name, text.encode())
            meta = self._meta(layout_name)
            manifest = on_disk.build_manifest(tmp, step=step, meta=meta, known=hashed)
            if final.exists():  # an older save of the same step (e.g. before a restart)
                shutil.rmtree(final)
            on_disk.commit_dir(tmp, final, manifest)
            self._apply_retention(step)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)  # free the space; the previous one stays
            return e
        return None

    def _global_state(self, step: int, plain: dict[str, Any]) -> dict[str, Any]:
        skip = (SAMPLER_AT_SAVE, HF_FILES, PER_RANK)  # the per-rank objects: in the rank files
        return {
            "step": step,
            "sampler": plain[SAMPLER_AT_SAVE],
            "plain": {k: v for k, v in plain.items() if k not in skip},
            "per_rank": sorted(plain.get(PER_RANK, {})),  # their names, checked on resume
            "config_toml": self.facts.config_toml,
        }

    def _meta(self, layout_name: str) -> dict[str, Any]:
        f = self.facts
        return {
            "world_size": f.world,
            "dp_size": f.dp,
            "accum": f.accum,
            "global_batch": f.global_batch,
            "micro_batch": f.micro_batch,
            "layout": layout_name,
            "config_digest": f.config_digest,
            "created_unix": time.time(),
        }

    def _apply_retention(self, newest: int) -> None:
        c = self.cfg
        found = {info.step: info.path for info in on_disk.list_checkpoints(self.root)}
        for step in on_disk.retention(
            found, keep_last=c.keep_last, keep_every=c.keep_every, newest_valid=newest
        ):
            shutil.rmtree(found[step], ignore_errors=True)

    def _agree(self, error: BaseException | None, step: int, what: str, tmp: Path) -> None:
        """Raise the same CheckpointError on every rank when any rank failed."""
        space = space_text(tmp) if error is not None else ""  # before rank 0 frees the space
        if not any_rank(error is not None, self.facts.device):
            return
        if self.facts.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the previous one stays
        where = (
            f"rank {self.facts.rank}: {error}{space}"
            if error is not None
            else "another rank failed (see its log)"
        )
        previous = self.newest_valid_step(checksums=False)
        raise CheckpointError(
            f"checkpoint of step {step} failed in {what} ({where}); training state is intact and "
            f"the previous checkpoint ({'step ' + str(previous) if previous is not None else 'none'}) "
            f"is still valid; free space in {self.root} or set checkpoint.dir"
        ) from error

    def newest_valid_step(self, checksums: bool = True) -> int | None:
        for info in reversed(on_disk.list_checkpoints(self.root)):
            if not on_disk.problems(info.path, checksums=checksums):
                return info.step
        return None
