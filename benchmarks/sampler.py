"""The sampler's cost against the dataset size: first batch, peak RSS, indices/s per rank.

    .venv/bin/python benchmarks/sampler.py [--repeats 5] [--sizes 1e6,1e7,1e8,1e9,1e10]
        [--legacy-sizes 1e6,1e7] [--out results.json]

Each measurement runs in a fresh Python process (``--child``), so that no cache, allocator
arena or page of an earlier size is reused, and the sizes are interleaved within each
repeat (1e6, 1e7, ..., 1e10, then again), so that a busy moment of a shared machine hits all
of them alike; the figures are medians over the repeats. A child is rank 3 of 8 with a global
batch of 512 (64 indices per rank and step) resumed in the middle of epoch 7 (the spot a
restarted run starts from), and measures:

- **first batch**: seconds from building the sampler, through ``load_state_dict`` and
  ``iter()``, to holding the rank's first 64 indices (imports excluded);
- **peak RSS**: the process's high-water mark (``ru_maxrss``) after the first batch, and its
  growth over the RSS the imports left (torch alone is a few hundred MiB);
- **indices/s**: this rank's indices per second over the next 2**18 positions.

Times are given as wall and as the process's CPU time: on a shared machine the wall figures
include waiting for a core, the CPU figures do not.

``--legacy-sizes`` measures the earlier sampler's order (``torch.randperm`` of N per epoch,
which a checkpoint saved without an ``order`` key still resumes with) at the same spot, for
comparison; keep them small, it costs N indices per rank.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RANK, WORLD, GLOBAL_BATCH = 3, 8, 512
RATE_INDICES = 1 << 18


def rss_mib() -> float:
    """Resident set size now, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(num_samples: int, legacy: bool) -> dict[str, Any]:
    from meshrun.data import ResumableSampler

    base_rss = rss_mib()
    t0, c0 = time.perf_counter(), time.process_time()
    sampler = ResumableSampler(
        num_samples, rank=RANK, world_size=WORLD, global_batch=GLOBAL_BATCH, seed=1
    )
    state = {**sampler.state_dict(), "consumed": 7 * num_samples + num_samples // 2}
    if legacy:
        del state["order"]  # as the earlier sampler saved it
    sampler.load_state_dict(state)
    stream = iter(sampler)
    first = list(itertools.islice(stream, GLOBAL_BATCH // WORLD))
    first_s, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t1, c1 = time.perf_counter(), time.process_time()
    rest = sum(1 for _ in itertools.islice(stream, RATE_INDICES))
    rate, cpu_rate = rest / (time.perf_counter() - t1), rest / (time.process_time() - c1)
    assert len(set(first)) == len(first) and all(0 <= i < num_samples for i in first)
    return {
        "first_batch_s": first_s,
        "first_batch_cpu_s": first_cpu,
        "peak_rss_mib": peak,
        "rss_after_imports_mib": base_rss,
        "growth_mib": peak - base_rss,
        "indices_per_s": rate,
        "indices_per_cpu_s": cpu_rate,
    }


def measure(num_samples: int, legacy: bool) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", str(num_samples)] + (["--legacy"] if legacy else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def sizes(text: str) -> list[int]:
    return [int(float(s)) for s in text.split(",") if s.strip()]


def summarise(rows: list[dict[str, Any]]) -> dict[str, float]:
    keys = (
        "first_batch_s",
        "first_batch_cpu_s",
        "peak_rss_mib",
        "growth_mib",
        "indices_per_s",
        "indices_per_cpu_s",
    )
    return {k: statistics.median(r[k] for r in rows) for k in keys}


def report(results: dict[str, dict[str, float]]) -> None:
    print(
        f"{'order':7} {'N':>7} {'first batch wall / CPU':>23} {'peak RSS':>10} {'growth':>9} "
        f"{'indices/s wall / CPU':>21}"
    )
    for name, s in results.items():
        order, n = name.split(":")
        print(
            f"{order:7} {float(n):7.0e} {s['first_batch_s'] * 1e3:8.2f} / {s['first_batch_cpu_s'] * 1e3:6.2f} ms "
            f"{s['peak_rss_mib']:6.1f} MiB {s['growth_mib']:5.1f} MiB "
            f"{s['indices_per_s'] / 1e6:7.2f} / {s['indices_per_cpu_s'] / 1e6:5.2f} M"
        )
    keyed = [s for name, s in results.items() if name.startswith("keyed")]
    if len(keyed) >= 2:
        spread = max(s["peak_rss_mib"] for s in keyed) - min(s["peak_rss_mib"] for s in keyed)
        slowest = max(s["first_batch_s"] for s in keyed)
        print(
            f"keyed order: peak RSS spread over the sizes {spread:.2f} MiB (target < 5), "
            f"slowest median first batch {slowest * 1e3:.2f} ms wall (target < 10)"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sizes", type=sizes, default=sizes("1e6,1e7,1e8,1e9,1e10"))
    p.add_argument("--legacy-sizes", type=sizes, default=sizes("1e6,1e7"))
    p.add_argument("--out", type=Path)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--legacy", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.child, a.legacy)))
        return
    variants = [("keyed", n) for n in a.sizes] + [("legacy", n) for n in a.legacy_sizes]
    rows: dict[str, list[dict[str, Any]]] = {f"{o}:{n}": [] for o, n in variants}
    for _ in range(a.repeats):
        for order, n in variants:  # interleaved: each repeat visits every size once
            rows[f"{order}:{n}"].append(measure(n, order == "legacy"))
    results = {name: summarise(r) for name, r in rows.items()}
    report(results)
    if a.out:
        a.out.write_text(json.dumps({"medians": results, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
