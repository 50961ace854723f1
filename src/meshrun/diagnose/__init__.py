"""Diagnostics that run through the real launcher.

Entry points: :func:`local_checks` of :class:`DoctorOptions` (``meshrun doctor``, the
pre-flight checklist of a node; ``launch --doctor`` runs it on every rank, docs/doctor.md),
and the measurements of ``meshrun bench`` (:func:`bench_comm`, :func:`bench_compute`,
:func:`bench_tp`, :func:`bench_fsdp`, in the workers of a launch) that
:func:`write_calibration` turns into the planner's calibration file (docs/plan.md). Exports
load on first use.
"""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.diagnose.bench_comm import bench_comm
    from meshrun.diagnose.bench_compute import bench_compute, bench_fsdp, bench_tp
    from meshrun.diagnose.calibration import write_calibration
    from meshrun.diagnose.doctor import DoctorOptions, local_checks

__getattr__ = lazy_exports(
    globals(),
    {
        "bench_comm": "meshrun.diagnose.bench_comm",
        "bench_compute": "meshrun.diagnose.bench_compute",
        "bench_fsdp": "meshrun.diagnose.bench_compute",
        "bench_tp": "meshrun.diagnose.bench_compute",
        "write_calibration": "meshrun.diagnose.calibration",
        "DoctorOptions": "meshrun.diagnose.doctor",
        "local_checks": "meshrun.diagnose.doctor",
    },
)

__all__ = [
    "DoctorOptions",
    "bench_comm",
    "bench_compute",
    "bench_fsdp",
    "bench_tp",
    "local_checks",
    "write_calibration",
]
