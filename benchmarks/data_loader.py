"""Loader throughput: samples/s of meshrun's data path alone, per rank (no model, no GPU).

    .venv/bin/python benchmarks/data_loader.py [--nproc 2] [--seq-len 1024] [--batches 200]

Prepares the demo's corpus (the local standard library's ``.py`` files, as
``meshrun.demo.corpus`` picks them, linked into a temporary directory; byte tokenizer) into
token shards once, then reads it with ``meshrun.data.bench.bench_ranks`` (the same path as
``meshrun bench data``) in NPROC processes at once, with 0 and 2 loader workers per rank, in
interleaved repeats. Also times ``meshrun data prepare`` itself (tokens/s) on that corpus.
A training step that consumes S samples per rank in T seconds needs S / T samples/s: the
loader keeps up while its figure is well above that.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from meshrun.data.bench import bench_ranks
from meshrun.data.prepare import prepare
from meshrun.demo.corpus import _stdlib_root, stdlib_files


def link_corpus(dest: Path) -> Path:
    root = _stdlib_root()
    for path in stdlib_files(10**12):
        link = dest / path.relative_to(root)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)
    return dest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = link_corpus(Path(tmp) / "corpus")
        t0 = time.perf_counter()
        m = prepare(source, Path(tmp) / "tokens", shard_tokens=2**22)
        prep_s = time.perf_counter() - t0
        print(
            f"prepare: {m.total_tokens / 1e6:.1f} M tokens, {m.documents} files in "
            f"{prep_s:.1f} s = {m.total_tokens / prep_s / 1e6:.1f} M tokens/s"
        )
        rates: dict[int, list[float]] = {0: [], 2: []}
        for _ in range(a.repeats):
            for workers in rates:  # interleaved: a busy moment hits both variants
                per_rank = bench_ranks(
                    Path(tmp) / "tokens",
                    a.nproc,
                    seq_len=a.seq_len,
                    micro_batch=a.micro_batch,
                    num_workers=workers,
                    batches=a.batches,
                )
                rates[workers].append(statistics.median(r.samples_per_s for r in per_rank))
        for workers, values in rates.items():
            med = statistics.median(values)
            print(
                f"loader, {workers} workers/rank, {a.nproc} ranks, seq_len {a.seq_len}: "
                f"median per rank {med:,.0f} samples/s = {med * a.seq_len / 1e6:.2f} M tokens/s "
                f"(runs: {', '.join(f'{v:,.0f}' for v in values)})"
            )


if __name__ == "__main__":
    main()
