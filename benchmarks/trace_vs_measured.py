"""Traced memory (parallel/memory_trace.py) against measured memory: the tables in docs/plan.md.

    PYTHONPATH=src python benchmarks/trace_vs_measured.py cpu [model]  # the CPU table
    PYTHONPATH=src python benchmarks/trace_vs_measured.py published  # the published rows
    PYTHONPATH=src python benchmarks/trace_vs_measured.py pp [model]  # the pipeline rows alone

``cpu``: for the demo GPT, a dense Hugging Face model (Llama) and an MoE one (Qwen3-MoE),
tiny configs built on the meta device, under DDP, ZeRO-1, ZeRO-3, TP 2 and ZeRO-3 with full
activation checkpointing on 2 ranks: the trace (one process, fake tensors, a fake world)
against a real run (2 Gloo processes, meshrun's parallelize, real tensors, bf16 compute).
Measured peak = the allocated peak of one training step after a warm-up step, counted on
rank 0 by torch's ``MemTracker`` (``FSDPMemTracker`` under FSDP2) over the real tensors, with
the model's parameters, gradients and optimizer states registered before the step. CPU torch
has no allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU twin) and RSS
deltas mix in glibc's caching and the Python heap, so the count of live tensor storages is
the measurement; what it checks is the trace's fake execution, its fake world and its
extrapolation against the real run. Both sides are "allocated" (no GPU allocator on a CPU).

Pipeline rows: pp=2 (1F1B, GPipe, interleaved 1F1B and ZB1P with 2 stages a rank, ZB-V and
DualPipeV with 2 in a V; 4 micro-batches of ``MICRO`` rows) through meshrun's own pipeline
(``parallelize_pipeline`` + ``pipeline_step``: torch's schedules), measured on each rank (each
stage) the same way, with the stage's receive buffers (torch's
``PipelineStage`` allocates them at the first step) registered beside the parameters; the
trace's first and last stage (the 2-stage schedules: its first and last rank, each with both
of its stages) against them, and its worst stage against the worse of the two.

``published``: torchtitan's Llama 3.1 8B on 8 H100 (FSDP, selective per-op AC, local batch
2, sequence 8,192, bf16): measured 82.4 GiB reserved, the trace's reserved peak and the
formula's figure beside it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

SEQ, MICRO = 128, 4
LAYOUTS = {  # name: (dp_shard, tp, zero, activation_checkpoint)
    "DDP": (2, 1, 0, 0),
    "ZeRO-1": (2, 1, 1, 0),
    "ZeRO-3": (2, 1, 3, 0),
    "TP 2": (1, 2, 0, 0),
    "ZeRO-3 + AC": (2, 1, 3, 1),
}


def build(name: str) -> nn.Module:
    """The three models, on the meta device."""
    with torch.device("meta"):
        if name == "demo GPT":
            from meshrun.demo.model import GPT, GPTConfig

            return GPT(GPTConfig(seq_len=SEQ, n_layer=4, n_head=4, d_model=128))
        from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

        common: dict[str, Any] = dict(
            vocab_size=512,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
        if name == "Llama (dense)":
            config: Any = LlamaConfig(intermediate_size=256, **common)
        else:
            config = Qwen3MoeConfig(
                intermediate_size=256,
                moe_intermediate_size=64,
                num_experts=4,
                num_experts_per_tok=2,
                head_dim=32,
                **common,
            )
        return AutoModelForCausalLM.from_config(config)


def traced(name: str, layout: tuple[int, int, int, int]) -> float:
    from meshrun.parallel.memory_trace import TraceLayout, trace

    dp, tp, zero, ac = layout
    lay = TraceLayout(
        dp_shard=dp,
        tp=tp,
        zero=zero,
        micro_batch=MICRO,
        seq=SEQ,
        ac="full" if ac else "none",
        precision="bf16",
        gpu=False,
    )
    return trace(build(name), lay).allocated


def _measure_rank(rank: int, name: str, layout: tuple[int, int, int, int], out: Any) -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from meshrun.config import ParallelConfig
    from meshrun.parallel import build_optimizer, parallelize
    from meshrun.parallel.memory_trace import _loss
    from meshrun.runtime.mesh import ParallelDims, build_mesh

    dist.init_process_group("gloo", rank=rank, world_size=2)
    dp, tp, zero, ac = layout
    mesh = build_mesh(ParallelDims(1, 1, dp, tp), "cpu")
    cfg = ParallelConfig(  # meshrun's defaults otherwise, as the trace uses them
        dp_shard=dp, tp=tp, zero=zero, activation_checkpoint=ac, param_dtype="bfloat16"
    )
    model = parallelize(build(name), mesh, cfg, torch.device("cpu"))
    opt = build_optimizer(model, torch.optim.AdamW, mesh, cfg, lr=1e-4, foreach=False)
    vocab = next(m for m in model.modules() if isinstance(m, nn.Embedding)).num_embeddings
    tokens = torch.randint(0, vocab, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        _loss(model, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's states exist from here on, as in the trace
    inner = model.module if hasattr(model, "module") else model
    if isinstance(inner, FSDPModule):
        tracker: Any = FSDPMemTracker(inner, opt)
        tracker.track_inputs((tokens,))
    else:
        tracker = MemTracker()
        tracker.track_external(model, getattr(opt, "optim", opt), tokens)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")
    if rank == 0:
        out.put(float(next(iter(peak.values()))["Total"]))
    dist.destroy_process_group()


def measured(name: str, layout: tuple[int, int, int, int]) -> float:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 1000))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_measure_rank, args=(r, name, layout, out)) for r in range(2)]
    for p in procs:
        p.start()
    value = out.get(timeout=600)
    for p in procs:
        p.join(timeout=120)
    return float(value)


PP_SCHEDULES, CHUNKS = ("1f1b", "gpipe", "interleaved", "zb1p", "zbv", "dualpipev"), 4
LABELS = {
    "1f1b": "1F1B",
    "gpipe": "GPipe",
    "interleaved": "interleaved 1F1B, 2 stages a rank",
    "zb1p": "ZB1P, 2 stages a rank",
    "zbv": "ZB-V (stages 0, 3 and 1, 2)",
    "dualpipev": "DualPipeV (stages 0, 3 and 1, 2)",
}


def traced_pp(name: str, schedule: str) -> Any:
    from meshrun.parallel.memory_trace import TraceLayout, trace

    lay = TraceLayout(
        pp=2,
        micro_batch=MICRO,
        seq=SEQ,
        precision="bf16",
        microbatches=CHUNKS,
        schedule=schedule,
        virtual=2,  # interleaved, zb1p: parallel.pp_virtual_stages' default, as measured
        gpu=False,
    )
    return trace(build(name), lay)


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _measure_pp_rank(rank: int, name: str, schedule: str, out: Any) -> None:
    from meshrun.config import ParallelConfig
    from meshrun.parallel import build_optimizer, parallelize_pipeline
    from meshrun.parallel.trace_stages import measured_stage_peak
    from meshrun.runtime.mesh import ParallelDims, build_mesh

    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = build_mesh(ParallelDims(2, 1, 1, 1), "cpu")
    cfg = ParallelConfig(pp=2, pp_schedule=schedule, pp_microbatches=CHUNKS, param_dtype="bfloat16")
    cpu = torch.device("cpu")
    pipe = parallelize_pipeline(build(name), mesh, cfg, cpu, _lm_loss)
    opt = build_optimizer(pipe, torch.optim.AdamW, mesh, cfg, lr=1e-4, foreach=False)
    vocab = {"demo GPT": 256}.get(name, 512)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (MICRO * CHUNKS, SEQ + 1), generator=g)
    out.put((rank, measured_stage_peak(pipe, opt, tokens)))
    dist.destroy_process_group()


def measured_pp(name: str, schedule: str) -> list[float]:
    """Each stage's (rank's) measured peak, first stage first."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29600 + os.getpid() % 1000))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (name, schedule, out)
    procs = [ctx.Process(target=_measure_pp_rank, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    values = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=120)
    return [v for _, v in values]


def pp_rows(name: str, schedules: tuple[str, ...] = PP_SCHEDULES) -> None:
    for schedule in schedules:
        label = f"PP 2, {LABELS[schedule]}, {CHUNKS} mb"
        try:
            t = traced_pp(name, schedule)
        except Exception as e:  # a row the trace cannot run says why
            print(f"| {name} | {label} | - | - | not traced: {type(e).__name__}: {e} | - |")
            continue
        m = measured_pp(name, schedule)
        ranks = schedule not in ("1f1b", "gpipe")  # each rank holds 2 stages
        first, last = ("rank 0", "rank 1") if ranks else ("first stage", "last stage")
        rows = [(first, m[0], t.stages[0]), (last, m[1], t.stages[-1])]
        rows.append(("worst stage", max(m), t.allocated))
        for which, mb, tb in rows:
            print(
                f"| {name} | {label}: {which} | {mb / 1e6:.2f} | {tb / 1e6:.2f} | "
                f"{(tb / mb - 1) * 100:+.1f} % | {t.seconds:.1f} |",
                flush=True,
            )


MODELS = ("demo GPT", "Llama (dense)", "Qwen3-MoE")


def cpu_table(names: tuple[str, ...] = MODELS) -> None:
    print("| model | layout | measured MB | traced MB | error | trace s |")
    print("|---|---|---|---|---|---|")
    for name in names:
        for label, layout in LAYOUTS.items():
            start = time.perf_counter()
            try:
                t = traced(name, layout)
            except Exception as e:  # a row the trace cannot run says why
                print(f"| {name} | {label} | - | - | not traced: {type(e).__name__} | - |")
                continue
            seconds = time.perf_counter() - start
            m = measured(name, layout)
            print(
                f"| {name} | {label} | {m / 1e6:.2f} | {t / 1e6:.2f} | "
                f"{(t / m - 1) * 100:+.1f} % | {seconds:.1f} |",
                flush=True,
            )
        pp_rows(name)


def published() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from meshrun.parallel.memory_trace import TraceLayout, trace

    start = time.perf_counter()
    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    lay = TraceLayout(dp_shard=8, zero=3, micro_batch=2, seq=8192, ac="selective")
    t = trace(model, lay)
    gib = 2**30
    print(
        f"torchtitan Llama 3.1 8B FSDP 8: measured 82.4 GiB; traced reserved "
        f"{t.reserved / gib:.1f} GiB ({(t.reserved / gib / 82.4 - 1) * 100:+.1f} %), allocated "
        f"{t.allocated / gib:.1f} GiB; parts GiB "
        + ", ".join(f"{k} {v / gib:.2f}" for k, v in t.parts.items())
        + f"; trace {t.seconds:.1f} s, whole script {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    if which == "pp":  # the pipeline rows alone: pp [model ...] [schedule ...]
        print("| model | layout | measured MB | traced MB | error | trace s |")
        print("|---|---|---|---|---|---|")
        picked = tuple(a for a in sys.argv[2:] if a in PP_SCHEDULES) or PP_SCHEDULES
        for name in [a for a in sys.argv[2:] if a not in PP_SCHEDULES] or MODELS:
            pp_rows(name, picked)
    elif which == "cpu":  # cpu [model ...]: the whole table, or some models' rows
        cpu_table(tuple(sys.argv[2:]) or MODELS)
    else:  # published
        published()
