"""Memory figures for one process, as plain numbers for `MetricsLogger(extra=...)`.

CUDA devices report the caching allocator's peak and reserved bytes; every other device
reports the host process's resident set, which is where CPU (and Gloo) training keeps
its tensors. Keys start with ``mem_`` so the logger can pick out peak memory.
"""

from __future__ import annotations

import os
import sys

import torch

_MB = 1024.0 * 1024.0


def memory_stats(device: torch.device) -> dict[str, float]:
    """Return memory use in MiB for ``device``.

    CUDA: ``mem_peak_alloc_mb`` and ``mem_reserved_mb``. Otherwise the host process:
    ``mem_rss_mb`` (current, where the platform exposes it) and ``mem_peak_rss_mb``.
    """
    # Only touch torch.cuda for a CUDA device: on CPU runs it may be unbuilt or
    # initialise a context nobody asked for.
    if device.type == "cuda":
        return {
            "mem_peak_alloc_mb": torch.cuda.max_memory_allocated(device) / _MB,
            "mem_reserved_mb": torch.cuda.memory_reserved(device) / _MB,
        }
    return _host_memory_stats()


def _host_memory_stats() -> dict[str, float]:
    """Current and peak resident set size of this process, in MiB (keys absent if unknown)."""
    stats: dict[str, float] = {}
    rss = _current_rss_bytes()
    if rss is not None:
        stats["mem_rss_mb"] = rss / _MB
    peak = _peak_rss_bytes()
    if peak is not None:
        stats["mem_peak_rss_mb"] = peak / _MB
    return stats


def _current_rss_bytes() -> int | None:
    # /proc/self/statm is "size resident shared ..." in pages; cheap enough to read
    # every logged step. Without /proc (macOS, Windows) the current RSS is unknown
    # and we say so by leaving the key out rather than reporting the peak as current.
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int | None:
    try:
        import resource  # not on Windows
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux but bytes on macOS.
    return peak if sys.platform == "darwin" else peak * 1024
