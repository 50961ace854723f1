"""Monitoring: per-step metrics, memory figures and the end-of-run summary; run health.

Entry point: `MetricsLogger`, fed numbers by the training loop (it holds no process
group code); `memory_stats(device)` supplies the ``mem_*`` figures for its ``extra``.
`StepMonitor` (one per run, built by the step loop) adds the step breakdown, the numerics
guard, straggler checks and the hang watchdog (docs/monitor.md).
"""

from meshrun.monitor.memory import memory_stats
from meshrun.monitor.metrics import METRICS_FILE, MetricsLogger
from meshrun.monitor.numerics import NonFiniteLossError
from meshrun.monitor.step import StepMonitor

__all__ = [
    "METRICS_FILE",
    "MetricsLogger",
    "NonFiniteLossError",
    "StepMonitor",
    "memory_stats",
]
