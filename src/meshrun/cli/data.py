"""``meshrun data prepare | verify``: the command-line face of data/prepare.py and shards.py;
and ``meshrun bench data`` (:func:`add_bench_data`, mounted by cli/diagnose.py), the loader
benchmark of data/bench.py."""

from __future__ import annotations

import argparse
import sys

from meshrun.data.prepare import DEFAULT_SHARD_TOKENS, prepare
from meshrun.data.shards import load_manifest, verify_dataset
from meshrun.runtime.logs import say_error

__all__ = ["add_bench_data", "add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("data", help="prepare token shards from text files and verify them")
    dsub = p.add_subparsers(dest="data_cmd", required=True)
    prep = dsub.add_parser(
        "prepare",
        help="tokenize text files into memory-mappable shards + manifest (resumable)",
        description="Tokenize every file of a directory (recursively) or a glob, in sorted "
        "order, each followed by an end-of-document token, into fixed-size NumPy shards "
        "with a manifest of token counts and sha256 checksums. Rerun the same command after "
        "an interruption: finished work is kept and the shards come out byte-identical.",
    )
    prep.add_argument("source", help="a directory or a quoted glob such as 'corpus/**/*.txt'")
    prep.add_argument("--out", required=True, help="output directory")
    prep.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (built in, default), tiktoken:NAME or hf:FILE_OR_NAME (optional packages)",
    )
    prep.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS})",
    )
    prep.add_argument("--workers", type=int, default=0, help="processes (default: every core)")
    prep.set_defaults(fn=_cmd_prepare)
    ver = dsub.add_parser("verify", help="check every shard against the manifest's checksums")
    ver.add_argument("dir", help="a directory made by `meshrun data prepare`")
    ver.set_defaults(fn=_cmd_verify)


def add_bench_data(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str = "data"
) -> None:
    """``meshrun bench data``: the bench command mounts it among its kinds (one spelling only:
    every measurement of the machine lives under ``meshrun bench``)."""
    b = sub.add_parser(
        name,
        help="samples/s of the data loader alone, per rank",
        description="Read a prepared token dataset in NPROC processes at once, each rank "
        "through the training path (TokenDataset, ResumableSampler, build_dataloader), "
        "and report samples/s and tokens/s per rank: whether data can keep up before training.",
    )
    b.add_argument("dir", help="a directory made by `meshrun data prepare`")
    b.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (default 1024)")
    b.add_argument("--micro-batch", type=int, default=8, help="samples per batch (default 8)")
    b.add_argument("--num-workers", type=int, default=0, help="loader workers per rank (default 0)")
    b.add_argument(
        "--nproc-per-node",
        "--nproc",
        dest="nproc",
        type=int,
        help="ranks reading at once, as in training (default: GPUs, else 1)",
    )
    b.add_argument("--batches", type=int, default=50, help="timed batches per rank (default 50)")
    b.set_defaults(fn=_cmd_bench)


def _cmd_prepare(a: argparse.Namespace) -> int:
    try:
        prepare(
            a.source, a.out, tokenizer=a.tokenizer, shard_tokens=a.shard_tokens, workers=a.workers
        )
    except (ValueError, FileNotFoundError) as e:
        message = str(e).removeprefix("data prepare: ")
        say_error("data prepare", message)
        return 2
    return 0


def _bench_problems(a: argparse.Namespace) -> list[str]:
    """Flag errors, found before any process is spawned."""
    limits = [
        ("--nproc-per-node", a.nproc, 1),
        ("--seq-len", a.seq_len, 1),
        ("--micro-batch", a.micro_batch, 1),
        ("--batches", a.batches, 1),
        ("--num-workers", a.num_workers, 0),
    ]
    return [f"{flag} {value}: must be >= {low}" for flag, value, low in limits if value < low]


def _cmd_bench(a: argparse.Namespace) -> int:
    import torch

    from meshrun.data.bench import bench_ranks

    if a.nproc is None:  # one reader per accelerator, as training would run
        a.nproc = torch.cuda.device_count() or 1
    if problems := _bench_problems(a):
        say_error("bench data", "; ".join(problems))
        return 2
    try:
        load_manifest(a.dir)  # a wrong directory: say so before spawning readers
        rates = bench_ranks(
            a.dir,
            a.nproc,
            seq_len=a.seq_len,
            micro_batch=a.micro_batch,
            num_workers=a.num_workers,
            batches=a.batches,
        )
    except (ValueError, FileNotFoundError) as e:
        say_error("bench data", e)
        return 2
    print(
        f"loader alone: seq_len {a.seq_len}, micro-batch {a.micro_batch}, "
        f"{a.num_workers} workers per rank, {a.nproc} ranks"
    )
    for r in rates:
        print(f"  rank {r.rank}: {r.samples_per_s:10.1f} samples/s {r.tokens_per_s:12.0f} tokens/s")
    total = sum(r.samples_per_s for r in rates)
    print(f"  node:   {total:10.1f} samples/s {total * a.seq_len:12.0f} tokens/s")
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    try:
        problems = verify_dataset(a.dir)
    except (ValueError, FileNotFoundError) as e:
        say_error("data verify", e)
        return 2
    if problems:
        print(f"meshrun data verify: {len(problems)} problem(s) in {a.dir}:", file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        print("  prepare the data again (`meshrun data prepare ... --out DIR`)", file=sys.stderr)
        return 1
    m = load_manifest(a.dir)
    print(f"{a.dir}: ok, {len(m.shards)} shards, {m.total_tokens} tokens, tokenizer {m.tokenizer}")
    return 0
