"""Monitoring: per-step metrics, memory figures and the end-of-run summary; run health.

Entry point: `MetricsLogger`, fed numbers by the training loop (it holds no process
group code); `memory_stats(device)` supplies the ``mem_*`` figures for its ``extra``.
`StepMonitor` (one per run, built at start-up) adds the step breakdown, the numerics
guard, straggler checks, the replica check and the hang watchdog (docs/monitor.md). The run
report (``meshrun report``) is a layer of its own above this one, ``meshrun.report``. Exports
load on first use,
so the command line does not import torch to parse its arguments.
"""

from typing import TYPE_CHECKING

from meshrun._lazy import lazy_exports

if TYPE_CHECKING:
    from meshrun.monitor.memory import memory_stats
    from meshrun.monitor.metrics import METRICS_FILE, MetricsLogger
    from meshrun.monitor.numerics import NonFiniteLossError
    from meshrun.monitor.replicas_check import ReplicaMismatchError
    from meshrun.monitor.step import StepMonitor

__getattr__ = lazy_exports(
    globals(),
    {
        "memory_stats": "meshrun.monitor.memory",
        "METRICS_FILE": "meshrun.monitor.metrics",
        "MetricsLogger": "meshrun.monitor.metrics",
        "NonFiniteLossError": "meshrun.monitor.numerics",
        "ReplicaMismatchError": "meshrun.monitor.replicas_check",
        "StepMonitor": "meshrun.monitor.step",
    },
)

__all__ = [
    "METRICS_FILE",
    "MetricsLogger",
    "NonFiniteLossError",
    "ReplicaMismatchError",
    "StepMonitor",
    "memory_stats",
]
