"""What context parallel costs and saves on CPU: cp = 2 against one rank, on a long sequence.

    .venv/bin/python benchmarks/cp_cost.py [--seq 1024] [--repeats 7] [--hidden 64] [--json OUT]

Two Gloo processes. Each repeat measures, interleaved so that load on the machine hits both
alike: (a) one rank: rank 0 trains a step of a Hugging Face Llama (built from a config, sdpa
attention) on the whole sequence while rank 1 waits; (b) cp = 2: both ranks train the same
step on their halves, the attention hooked by ``meshrun.parallel.cp.apply_cp`` (all-to-all
head scatter), the gradients averaged over the two ranks as DDP would. A step is the
forward, the loss, the backward and the gradient all-reduce (cp only).

Activation memory per rank is what autograd saves for the backward (the bytes of the distinct
storages the saved-tensor hooks see): the memory a step needs on top of the model. Prints the
median step time and activation bytes of each, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn


def build(hidden: int) -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        attn_implementation="sdpa",
        dtype=torch.float32,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def step(model: nn.Module, x: Tensor, y: Tensor, group: Any) -> tuple[float, int]:
    """(seconds, bytes saved for backward) of one training step."""
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    if group is not None:  # what DDP does: the gradients averaged over the cp ranks
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=group)
    return time.perf_counter() - t0, sum(seen.values())


def worker(rank: int, args: argparse.Namespace, port: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from meshrun.parallel.cp import apply_cp, shard_sequence
    from meshrun.parallel.structure import find_structure
    from meshrun.runtime.mesh import ParallelDims, build_mesh

    mesh = build_mesh(ParallelDims(1, 1, 1, 1, cp=2), "cpu")
    group = mesh.get_group("cp")
    one = build(args.hidden)
    cp_model = build(args.hidden)
    apply_cp(cp_model, mesh, find_structure(cp_model))
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (1, args.seq + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    xs, ys = shard_sequence((x, y), group)
    rows: dict[str, list[tuple[float, int]]] = {"one": [], "cp2": []}
    for i in range(args.repeats + 1):  # the first round warms up and is dropped
        dist.barrier()
        if rank == 0:
            one_row = step(one, x, y, None)
        dist.barrier()
        cp_row = step(cp_model, xs, ys, group)
        if i:
            rows["cp2"].append(cp_row)
            if rank == 0:
                rows["one"].append(one_row)
    out.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def summarise(by_rank: dict[int, dict[str, list[tuple[float, int]]]]) -> dict[str, Any]:
    def med(rows: list[tuple[float, int]], i: int) -> float:
        return statistics.median(r[i] for r in rows)

    one = by_rank[0]["one"]
    cp_time = max(med(by_rank[r]["cp2"], 0) for r in by_rank)  # a step ends with its slowest
    cp_bytes = max(med(by_rank[r]["cp2"], 1) for r in by_rank)
    return {
        "one_rank_step_s": med(one, 0),
        "cp2_step_s": cp_time,
        "step_time_ratio": cp_time / med(one, 0),
        "one_rank_activation_mib": med(one, 1) / 2**20,
        "cp2_activation_mib_per_rank": cp_bytes / 2**20,
        "activation_ratio": cp_bytes / med(one, 1),
        "cp2_per_rank_step_s": [med(by_rank[r]["cp2"], 0) for r in sorted(by_rank)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    from meshrun.runtime.ports import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    by_rank = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit("a worker failed")
    figures = {"seq": args.seq, "hidden": args.hidden, "repeats": args.repeats}
    figures |= summarise(by_rank)
    print(
        f"Llama h{args.hidden} 2 layers, S={args.seq}, {args.repeats} interleaved repeats "
        f"(medians): one rank {figures['one_rank_step_s'] * 1e3:.1f} ms/step, "
        f"{figures['one_rank_activation_mib']:.2f} MiB activations | cp=2 "
        f"{figures['cp2_step_s'] * 1e3:.1f} ms/step, {figures['cp2_activation_mib_per_rank']:.2f} "
        f"MiB activations per rank | ratios: time {figures['step_time_ratio']:.2f}, "
        f"activations {figures['activation_ratio']:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
