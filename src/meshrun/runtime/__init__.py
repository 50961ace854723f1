"""One process's place in the job, below every subsystem: which launcher started it
(``launcher_env``, ``mpi_rendezvous``), its device and backend (``device``), the named DeviceMesh
(``mesh``), rank-aware logs, the LR rules (``schedule``), the run directory's lock and
shared-storage check (``runlock``, ``storage``), host memory (``hostmem``), the shared
:class:`TrainState` (``state``), the one per-step agreement all-reduce (``agreement``) and the
job secret's key, HMAC and sanitizer (``secret``)."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.runtime.launcher_env import LauncherEnv, detect
    from meshrun.runtime.mesh import ParallelDims
    from meshrun.runtime.state import TrainState

__getattr__ = lazy_exports(
    globals(),
    {
        "LauncherEnv": "meshrun.runtime.launcher_env",
        "detect": "meshrun.runtime.launcher_env",
        "ParallelDims": "meshrun.runtime.mesh",
        "TrainState": "meshrun.runtime.state",
    },
)

__all__ = ["LauncherEnv", "ParallelDims", "TrainState", "detect"]
