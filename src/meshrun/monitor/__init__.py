"""Monitoring: per-step metrics, memory figures and the end-of-run summary.

Entry point: `MetricsLogger`, fed numbers by the training loop (it holds no process
group code); `memory_stats(device)` supplies the ``mem_*`` figures for its ``extra``.
"""

from meshrun.monitor.memory import memory_stats
from meshrun.monitor.metrics import METRICS_FILE, MetricsLogger

__all__ = ["METRICS_FILE", "MetricsLogger", "memory_stats"]
