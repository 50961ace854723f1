"""Ray: ``meshrun ray`` runs the script as a Ray Train job (``job``), each worker starting
meshrun's runtime (``worker``), failures summarised as ``meshrun launch`` does (``summary``,
``callback``). See docs/ray.md."""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.launch.ray.job import RayLaunchSpec, launch_ray

__getattr__ = lazy_exports(
    globals(),
    {"RayLaunchSpec": "meshrun.launch.ray.job", "launch_ray": "meshrun.launch.ray.job"},
)

__all__ = ["RayLaunchSpec", "launch_ray"]
