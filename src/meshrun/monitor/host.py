"""Host network throughput and GPU utilisation, power and clocks, for logged steps' metrics.

Network: bytes received and sent per second over the host's interfaces except loopback,
from ``/proc/net/dev`` (Linux), between two logged steps: ``net_rx_mb_s``, ``net_tx_mb_s``
(MiB/s; the whole host, every process on it, not this rank alone). Loopback is left out
because on one node it carries the local Gloo traffic and would read as "network"; a
multi-node job's collectives cross the real interfaces.

GPU (CUDA only, when ``nvidia-ml-py`` is installed): ``gpu_util_pct`` and ``gpu_mem_util_pct``
(NVML's share of the last sample period the GPU / its memory was busy), ``gpu_power_w``,
``gpu_sm_clock_mhz``, for this rank's device, matched by PCI bus id (NVML numbers GPUs
physically, CUDA after ``CUDA_VISIBLE_DEVICES``). Without the package a CUDA run says so once
and goes on without these keys.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from meshrun.runtime.logs import OWN_HOST

__all__ = ["HostStats", "parse_net_dev"]

log = logging.getLogger("meshrun")
_MB = 1024.0 * 1024.0
_NET_DEV = Path("/proc/net/dev")


def parse_net_dev(text: str) -> tuple[int, int]:
    """Total (received, sent) bytes over the non-loopback interfaces in /proc/net/dev."""
    rx = tx = 0
    for line in text.splitlines()[2:]:  # two header lines
        name, _, fields = line.partition(":")
        values = fields.split()
        if name.strip() == "lo" or len(values) < 9:
            continue
        rx += int(values[0])
        tx += int(values[8])
    return rx, tx


class HostStats:
    """``sample()`` at each logged step: the figures since the previous sample."""

    def __init__(self, device: torch.device) -> None:
        self._last: tuple[float, int, int] | None = None
        self._net = _NET_DEV.is_file()
        self._gpu: Any = _nvml_handle(device) if device.type == "cuda" else None

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._net:
            out |= self._network()
        if self._gpu is not None:
            out |= _gpu_stats(self._gpu)
        return out

    def _network(self) -> dict[str, float]:
        try:
            rx, tx = parse_net_dev(_NET_DEV.read_text())
        except (OSError, ValueError):
            self._net = False
            log.warning("host network figures off: %s could not be read", _NET_DEV, extra=OWN_HOST)
            return {}
        now = time.monotonic()
        last, self._last = self._last, (now, rx, tx)
        if last is None or now <= last[0]:
            return {}  # the first sample is the baseline
        dt = now - last[0]
        return {"net_rx_mb_s": (rx - last[1]) / dt / _MB, "net_tx_mb_s": (tx - last[2]) / dt / _MB}


def _nvml_handle(device: torch.device) -> Any:
    """This device's NVML handle, or None (with one log line saying why)."""
    try:
        import pynvml  # the optional nvidia-ml-py
    except ImportError:
        log.info("GPU utilisation, power and clocks not reported: pip install nvidia-ml-py")
        return None
    try:
        pynvml.nvmlInit()
        p = torch.cuda.get_device_properties(device)
        ids = [getattr(p, f"pci_{k}_id") for k in ("domain", "bus", "device")]
        return pynvml.nvmlDeviceGetHandleByPciBusId("{:08X}:{:02X}:{:02X}.0".format(*ids))
    except Exception as e:  # NVML missing from the driver, no permission, ...
        log.warning("GPU utilisation, power and clocks not reported: NVML: %s", e, extra=OWN_HOST)
        return None


def _gpu_stats(handle: Any) -> dict[str, float]:
    import pynvml

    util = pynvml.nvmlDeviceGetUtilizationRates(handle)
    return {
        "gpu_util_pct": float(util.gpu),
        "gpu_mem_util_pct": float(util.memory),
        "gpu_power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,  # milliwatts
        "gpu_sm_clock_mhz": float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
    }
