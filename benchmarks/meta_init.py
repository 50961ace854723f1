"""Cost of initialising a meta-built model to one process's values (parallel/meta_init.py).

    PYTHONPATH=src .venv/bin/python benchmarks/meta_init.py [--repeats 3] [--dim 768]
        [--layers 12] [--vocab 32000] [--json OUT]

A user-style Transformer (wq/wk/wv/wo attention, a 4x feed-forward, LayerNorms, token and
position embeddings, ``init_weights`` calling each layer's ``reset_parameters()`` and
``nn.init``; 134M parameters by default) is built on the meta device and then allocated and
initialised two ways, each in fresh processes (peak memory is per process):

- ``old``: what meshrun did before: ``to_empty`` then ``init_weights()`` on each rank's own
  tensors (under ZeRO-3 each rank draws its shards from the same seed: not one process's
  values);
- ``new``: ``meshrun.parallel.fsdp.materialize``: the initialiser once on full host copies,
  each rank keeping its slice.

Configurations: one process (no mesh), and 2 Gloo ranks under ZeRO-3 (``fully_shard`` of each
block, then the root, as ``parallelize`` does). Runs alternate old/new (interleaved), each
configuration ``--repeats`` times. Per run: the seconds of the allocation plus initialisation
(the slowest rank's; wall clock and the process's CPU time, which a loaded machine disturbs
less), and the peak resident memory it added (``ru_maxrss`` after it minus the
resident memory before it, the largest over ranks). Prints medians and new/old ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch import Tensor, nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.ffn_norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:  # never called here: the cost is the init's
        return x

    def reset_parameters(self) -> None:
        for m in self.children():
            m.reset_parameters()  # type: ignore[operator]


class Transformer(nn.Module):
    def __init__(self, dim: int, layers: int, vocab: int, seq: int = 2048) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def init_weights(self) -> None:
        self.tok_embeddings.reset_parameters()
        nn.init.normal_(self.pos_embeddings.weight, std=0.02)
        for layer in self.layers:
            layer.reset_parameters()  # type: ignore[operator]
        self.norm.reset_parameters()
        dim = self.output.weight.shape[1]
        nn.init.trunc_normal_(self.output.weight, std=1 / math.sqrt(dim), a=-0.1, b=0.1)


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def worker(mode: str, dim: int, layers: int, vocab: int) -> dict[str, Any]:
    """One rank: build on meta, shard if in a group, then time and measure the init."""
    import torch.distributed as dist

    from meshrun.parallel.fsdp import materialize

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(dim, layers, vocab)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        dist.barrier()
    before = rss_kib()
    t0, c0 = time.perf_counter(), time.process_time()
    if mode == "old":
        model.to_empty(device=torch.device("cpu"))
        with torch.no_grad():
            model.init_weights()
    else:
        materialize(model, torch.device("cpu"))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    if world > 1:
        dist.destroy_process_group()
    params = sum(p.numel() for p in model.parameters())
    return {"s": seconds, "cpu_s": cpu, "peak_mib": (peak - before) / 1024, "params_local": params}


def launch(mode: str, nproc: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run in fresh processes; the slowest rank's time, the largest rank's peak."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--worker", mode, *map(str, (args.dim, args.layers))]
    cmd.append(str(args.vocab))
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{mode} x{nproc} failed")
    return {
        "s": max(o["s"] for o in outs),
        "cpu_s": max(o["cpu_s"] for o in outs),
        "peak_mib": max(o["peak_mib"] for o in outs),
        "params_local": outs[0]["params_local"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--nproc", default="1,2", help="comma-separated process counts")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        mode, *dims = args.worker
        print(json.dumps(worker(mode, *map(int, dims))))
        return
    with torch.device("meta"):
        total = sum(p.numel() for p in Transformer(args.dim, args.layers, args.vocab).parameters())
    print(f"model: {total / 1e6:.1f}M parameters ({total * 4 / 2**20:.0f} MiB fp32)")
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for nproc in map(int, args.nproc.split(",")):
            for mode in ("old", "new"):  # interleaved: load drifts hit both alike
                r = launch(mode, nproc, args)
                runs.setdefault(f"{mode} x{nproc}", []).append(r)
                print(
                    f"  {mode} x{nproc}: {r['s']:.2f} s ({r['cpu_s']:.2f} s CPU),"
                    f" peak +{r['peak_mib']:.0f} MiB",
                    flush=True,
                )
    summary = {}
    for nproc in map(int, args.nproc.split(",")):
        med = {
            mode: {
                k: statistics.median(r[k] for r in runs[f"{mode} x{nproc}"])
                for k in ("s", "cpu_s", "peak_mib")
            }
            for mode in ("old", "new")
        }
        summary[nproc] = med
        old, new = med["old"], med["new"]
        print(
            f"{nproc} process(es): old {old['s']:.2f} s ({old['cpu_s']:.2f} s CPU),"
            f" +{old['peak_mib']:.0f} MiB; new {new['s']:.2f} s ({new['cpu_s']:.2f} s CPU),"
            f" +{new['peak_mib']:.0f} MiB; new/old: time {new['s'] / old['s']:.2f}x,"
            f" CPU {new['cpu_s'] / old['cpu_s']:.2f}x, memory {new['peak_mib'] / old['peak_mib']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": total, "runs": runs, "medians": summary}, f, indent=1)


if __name__ == "__main__":
    main()
