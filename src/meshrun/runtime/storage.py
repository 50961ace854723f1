"""Is the run directory shared by every rank? Checked once at start, before step 1.

The run directory holds what ranks read from each other: the checkpoints (every rank writes
its shards, rank 0 the metadata, and a resume reads all of them), the resolved config and
data that rank 0 prepares once (the demo's corpus). On separate hosts with separate disks each
node sees only its own part, and the run fails late and obscurely (a manifest "does not
exist" on rank 1, a checkpoint that no node can resume). So :func:`check_shared_run_dir`
proves the directory is shared before anything depends on it: rank 0 writes a marker file with
a name unique to this job and this start, every rank looks for it, and a rank that does not
see it stops the whole job with an error naming each host's directory and the fix.

Why an error and not per-node copies: checkpoints must be readable by every node for a resume
(after a node is replaced, or on another world size) to work, so a run directory that is not
shared cannot be made safe by preparing node-local data alone (docs/checkpoint.md).

The message and the marker's name are pure functions (unit-tested without processes); the
check itself is two small collectives.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from meshrun.runtime.runlock import RunDirError as RunDirError  # raised here; defined with the lock

MARKER_PREFIX = ".meshrun-shared-"
# A rank that does not see the marker looks again for this long before it gives up: on NFS a
# file closed on one client is visible to another's next lookup of a new name (close-to-open
# consistency), but a slow server or an attribute cache should not fail a shared directory.
LOOK_S = 2.0


@dataclass(frozen=True)
class Sighting:
    """What one rank saw: its host, its run directory (as it resolves it), the marker or not."""

    rank: int
    host: str
    directory: str
    seen: bool


def job_id(env: Mapping[str, str]) -> str:
    """A readable id of this job for the marker's name (the random token makes it unique)."""
    for key in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if env.get(key):
            return re.sub(r"[^A-Za-z0-9_.-]", "_", env[key])[:48]
    return "job"


def marker_name(job: str, token: str) -> str:
    return f"{MARKER_PREFIX}{job}-{token}"


def unshared_message(sightings: Sequence[Sighting], marker: str) -> str | None:
    """The error for ranks that did not see rank 0's marker, or None if every rank saw it."""
    missing = [s for s in sightings if not s.seen]
    if not missing:
        return None
    writer = next(s for s in sightings if s.rank == 0)
    by_place: dict[tuple[str, str], list[int]] = {}
    for s in missing:
        by_place.setdefault((s.host, s.directory), []).append(s.rank)
    places = "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {_ranks(r)} on {host} in {directory}"
        for (host, directory), r in by_place.items()
    )
    return (
        f"job.run_dir is not shared by all ranks: rank 0 on {writer.host} wrote {marker} in "
        f"{writer.directory}, and {len(missing)} of {len(sightings)} ranks do not see it "
        f"({places}). The run directory holds the checkpoints (every rank writes its shards, "
        "a resume reads all of them) and data rank 0 prepares for all, so it must be the same "
        "directory on every node: put it on storage every node mounts, e.g. "
        "--job.run_dir=/shared/runs/NAME (NFS, Lustre, a cloud file system), the same path "
        "on each node"
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]}"


def _look(path: Path, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _write_marker(path: Path, host: str) -> None:
    with open(path, "w") as f:  # closed (and so visible to other NFS clients) before the name
        f.write(f"written by rank 0 on {host}, pid {os.getpid()}\n")  # is sent to any rank
        f.flush()
        os.fsync(f.fileno())


def check_shared_run_dir(run_dir: Path, host: str, wait_s: float = LOOK_S) -> None:
    """Raise :class:`RunDirError` on every rank unless every rank sees a file that
    rank 0 writes in ``run_dir`` (a collective: every rank calls it; one process: nothing)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    name = ["", ""]  # [the marker's name, why rank 0 could not write it]
    if dist.get_rank() == 0:
        name[0] = marker_name(job_id(os.environ), secrets.token_hex(6))
        try:
            _write_marker(run_dir / name[0], host)
        except OSError as e:  # e.g. a full disk: every rank must stop, not wait for rank 0
            name[1] = f"job.run_dir {run_dir}: rank 0 on {host} cannot write in it: {e}"
    dist.broadcast_object_list(name, src=0)  # after the write: the name says the file exists
    if name[1]:
        raise RunDirError(name[1], every_rank=True)
    marker = run_dir / name[0]
    mine = Sighting(dist.get_rank(), host, str(run_dir.resolve()), _look(marker, wait_s))
    sightings: list[Sighting | None] = [None] * dist.get_world_size()
    dist.all_gather_object(sightings, mine)  # also the point after which nobody looks
    if dist.get_rank() == 0:
        marker.unlink(missing_ok=True)
    message = unshared_message([s for s in sightings if s is not None], name[0])
    if message:
        raise RunDirError(message, every_rank=True)
