"""Start-up checks of a loader's resources: worker processes against cores, ``/dev/shm``.

Both failures are silent otherwise: too many workers make every rank's loader and the
training threads fight for cores (slower, no error), and workers hand batches over through
shared memory, so a small ``/dev/shm`` (Docker's default is 64 MiB) ends in a "bus error" or
a worker killed by a signal minutes into the run.
"""

from __future__ import annotations

import os
import shutil

__all__ = ["SHM_PER_WORKER", "loader_resource_problems", "usable_cores"]

# A rough need per worker: prefetch_factor (2) batches of a few MiB each, times a margin.
# Meant to catch Docker's 64 MiB default, not to size large image batches exactly.
SHM_PER_WORKER = 64 * 2**20


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under SLURM or taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def loader_resource_problems(
    num_workers: int,
    local_world_size: int,
    *,
    cores: int | None = None,
    shm_free: int | None = None,
) -> list[str]:
    """Warnings for ``num_workers`` per rank with ``local_world_size`` ranks on this node."""
    if num_workers == 0:
        return []
    problems = []
    cores = usable_cores() if cores is None else cores
    workers = num_workers * local_world_size
    if workers + local_world_size > cores:
        fit = max((cores - local_world_size) // local_world_size, 0)
        problems.append(
            f"data.num_workers = {num_workers} x {local_world_size} processes on this node = "
            f"{workers} loader workers + {local_world_size} training processes for {cores} "
            f"cores: they will compete for CPU; set --data.num_workers={fit} or fewer"
        )
    free = _shm_free() if shm_free is None else shm_free
    need = workers * SHM_PER_WORKER
    if free is not None and free < need:
        problems.append(
            f"/dev/shm has {free / 2**20:.0f} MiB free; {workers} loader workers pass batches "
            f"through it and may need ~{need / 2**20:.0f} MiB (workers crash with 'bus error' "
            "when it fills): enlarge it (docker run --shm-size=8g, Kubernetes: an emptyDir "
            "with medium Memory at /dev/shm) or lower --data.num_workers"
        )
    return problems


def _shm_free() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:  # no /dev/shm (macOS): workers use other shared memory
        return None
