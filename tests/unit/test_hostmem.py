"""job.cpu_mmap_threshold_kib: freed host tensors leave the resident set (meshrun/runtime/hostmem.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshrun.runtime.hostmem import set_mmap_threshold

# Allocate, free, allocate and free a 24 MiB tensor; print the resident MiB that stay after.
PROBE = """
import sys, torch
from meshrun.runtime.hostmem import set_mmap_threshold
def rss_mib():
    return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) / 1024
set_mmap_threshold(int(sys.argv[1]))
(torch.ones(1024) * 2).sum()  # warm-up: torch's first op sets up pools (MiBs, once)
before = rss_mib()
for _ in range(2):
    t = torch.ones(6 * 1024 * 1024)  # 24 MiB, touched (below glibc's 32 MiB sliding cap)
    small = torch.ones(1024)  # a live block above it keeps the heap from trimming its top
    del t
print(rss_mib() - before)
"""


def kept_mib(threshold_kib: int) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(threshold_kib)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return float(out.stdout.strip())


def test_a_fixed_threshold_returns_freed_tensors_to_the_os() -> None:
    glibc_default, fixed = kept_mib(0), kept_mib(1024)
    # glibc slides its threshold up after the first free: the second 24 MiB block comes from
    # the heap and stays resident; with a fixed threshold both were unmapped on free.
    assert glibc_default > 16, (glibc_default, fixed)
    assert glibc_default - fixed > 12, (glibc_default, fixed)


def test_bounds() -> None:
    assert set_mmap_threshold(0) is False  # 0 = leave glibc alone
    with pytest.raises(ValueError, match="at most 32768 KiB"):
        set_mmap_threshold(65536)
