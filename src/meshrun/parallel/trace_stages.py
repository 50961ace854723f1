"""What one pipeline stage holds, for the memory trace (parallel/memory_trace.py).

A stage is not the model cut short: the first holds the embeddings and no head, the last the
final norm, the head and the loss and no embeddings, and each holds as many micro-batches'
activations as its schedule keeps in flight before their backward: GPipe all ``m`` on every
stage, 1F1B ``min(m, pp - s)`` on stage ``s`` (torch's ``Schedule1F1B`` runs that many warm-up
forwards, then one backward before each further forward). A stage also keeps, for the whole
run, one receive buffer per micro-batch for what it is sent: the previous stage's activations
(every stage but the first), the next stage's gradients (every stage but the last).

The first and the last stage are traced (a middle stage holds the blocks of the first and
fewer micro-batches, so it never holds more than the first). The stage modules are meshrun's
own (parallel/pp/stages.py), the ones ``run.pipeline`` trains.

Interleaved 1F1B with ``v`` > 1 stages per rank (``TraceLayout.virtual``): a rank holds stages
r, r + pp, ... of pp * v, and runs their forwards and backwards in the order torch's
``ScheduleInterleaved1F1B`` computes for it (:func:`interleaved_order`: its warm-up runs the
earlier stage's micro-batches first, so rank 0's first stage holds up to all m of them); the
first and the last rank are traced, each with all its stages, receive buffers and optimizer.
The zero-bubble schedules (zb1p looped, zbv and dualpipev in a V) are traced the same way, in
the order of torch's own class for each rank and with each backward split where torch splits
it (parallel/trace_ops.py: the input's gradient first with the graph kept, the weights' later,
so a chunk's activations live until its weight step). Under FSDP2 (zero 2 or 3) a rank of a
multi-stage schedule is still traced as one 1F1B stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

Loss = Callable[[Any, Tensor], Tensor]  # (the model's output, the tokens) -> the loss


@dataclass(frozen=True)
class StagePosition:
    """Stage ``index`` of ``pp``: its blocks and the micro-batches it holds at once."""

    index: int
    pp: int
    blocks: int
    held: int
    microbatches: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.pp - 1


def traced_positions(
    n_blocks: int, pp: int, microbatches: int, schedule: str
) -> list[StagePosition]:
    """The stages the trace runs: the first and the last (one when pp is 1)."""
    from meshrun.parallel.pp.split import split_blocks

    sizes = [len(r) for r in split_blocks(n_blocks, pp)] if pp > 1 else [n_blocks]
    m = max(microbatches, 1)
    out = []
    for s in sorted({0, pp - 1}):
        held = m if schedule == "gpipe" or pp == 1 else min(m, pp - s)
        out.append(StagePosition(s, pp, sizes[s], held if pp > 1 else 1, m))
    return out


def stage_module(model: nn.Module, pos: StagePosition) -> nn.Module:
    """``model``'s (a copy holding this stage's blocks) stage at ``pos``: meshrun's
    StageModule with the embeddings on the first stage, the norm and head on the last."""
    from meshrun.parallel.pp.split import split_model
    from meshrun.parallel.pp.stages import StageModule, StageParts, hf_context
    from meshrun.parallel.structure import find_structure, is_hf_model

    structure = find_structure(model)
    blocks = structure.block_names()
    kwargs, shared = hf_context(model, blocks) if is_hf_model(model) else (None, ())
    whole = split_model(model, structure, 1, shared).parts[0]
    parts = StageParts(
        whole.before if pos.first else (),
        whole.blocks,
        whole.after if pos.last else (),
        whole.shared,
    )
    stage = StageModule(model, parts, kwargs)
    stage.init_weights = model.init_weights  # no-op (fake)
    return stage


Op = tuple[int, str, int]  # (stage index, torch's action: "F", "B", "I" or "W", micro-batch)


@dataclass(frozen=True)
class RankPosition:
    """A pp rank of an interleaved pipeline: its stages (of pp * v) and its schedule's ops."""

    rank: int
    stages: tuple[StagePosition, ...]
    ops: tuple[Op, ...]

    @property
    def blocks(self) -> int:
        return max(s.blocks for s in self.stages)


def interleaved_order(rank: int, pp: int, v: int, microbatches: int) -> tuple[Op, ...]:
    """Rank ``rank``'s forwards and backwards under torch's ScheduleInterleaved1F1B, in order."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    return torch_rank_order(ScheduleInterleaved1F1B, rank, pp, v, microbatches)


def torch_rank_order(
    schedule_cls: type, rank: int, pp: int, v: int, microbatches: int
) -> tuple[Op, ...]:
    """Rank ``rank``'s ops under one of torch's multi-stage schedule classes with ``v`` stages
    per rank: torch's own computation (its per-rank method, given the sizes it reads), as
    (stage, "F" | "B" | "I" | "W", micro-batch); a paired action (DualPipeV's
    ``OVERLAP_F_B``) as the ops torch's runtime runs in turn."""
    from types import SimpleNamespace

    rounds = max(1, microbatches // pp)
    sizes = SimpleNamespace(  # what the classes' per-rank methods read of the schedule
        pp_group_size=pp,
        n_local_stages=v,
        num_stages=pp * v,
        microbatches_per_round=microbatches // rounds,
        _n_microbatches=microbatches,
    )
    out: list[Op] = []
    for a in schedule_cls._calculate_single_rank_operations(sizes, rank):  # type: ignore[attr-defined]
        for sub in (a.sub_actions or (a,)) if a is not None else ():
            if sub.microbatch_index is not None:
                out.append((sub.stage_index, sub.computation_type.value, sub.microbatch_index))
    return tuple(out)


def interleaved_positions(n_blocks: int, pp: int, v: int, microbatches: int) -> list[RankPosition]:
    """The first and the last pp rank of an interleaved pipeline, each with its v stages."""
    from meshrun.parallel.pp.split import split_blocks

    sizes = [len(r) for r in split_blocks(n_blocks, pp * v)]
    m = max(microbatches, 1)
    out = []
    for r in sorted({0, pp - 1}):
        ids = [r + k * pp for k in range(v)]
        stages = tuple(StagePosition(s, pp * v, sizes[s], m, m) for s in ids)
        out.append(RankPosition(r, stages, interleaved_order(r, pp, v, m)))
    return out


@dataclass
class StageIO:
    """What a traced stage is fed: the tokens (first stage) or one received activation per
    micro-batch, and one received gradient per micro-batch (all but the last stage)."""

    tokens: Tensor
    acts: list[Tensor]
    grads: list[Tensor]

    def tensors(self) -> list[Tensor]:
        return [self.tokens, *self.acts, *self.grads]


def stage_io(pos: StagePosition, tokens: Tensor, hidden: tuple[Any, torch.dtype]) -> StageIO:
    """The stage's receive buffers, alive for the whole run (torch's PipelineStage allocates
    one per micro-batch); ``hidden``: the shape and dtype of what the first stage sends."""
    m = pos.microbatches if pos.pp > 1 else 0
    shape, dtype = hidden
    acts = [] if pos.first else [torch.empty(shape, dtype=dtype) for _ in range(m)]
    grads = [] if pos.last else [torch.empty(shape, dtype=dtype) for _ in range(m)]
    return StageIO(tokens, acts, grads)


def output_meta(first: nn.Module, tokens: Tensor) -> tuple[Any, torch.dtype]:
    """What the (laid out) first stage sends: its output's shape and dtype (untracked)."""
    with torch.no_grad():
        out = first(tokens)
    return out.shape, out.dtype


def run_schedule(stage: nn.Module, pos: StagePosition, io: StageIO, loss: Loss) -> None:
    """The stage's forwards and backwards in its schedule's order, far enough to reach its
    peak: ``held`` forwards, then (one backward, one forward) once, then the backwards."""
    pending: list[Callable[[], None]] = []
    forwards = min(pos.held + 1, pos.microbatches) if pos.pp > 1 else 1
    for i in range(forwards):
        if len(pending) == pos.held:
            pending.pop(0)()
        pending.append(_forward(stage, pos, io, i, loss))
    while pending:
        pending.pop(0)()


def _forward(
    stage: nn.Module, pos: StagePosition, io: StageIO, i: int, loss: Loss
) -> Callable[[], None]:
    """One micro-batch's forward; returns its backward (which frees its activations)."""
    x: Any = io.tokens if pos.first else io.acts[i].detach().requires_grad_()
    # torch's stage keeps each micro-batch's output (the last stage's: its logits) until the
    # micro-batch's backward; one process's step frees the logits once the loss is computed.
    held: list[Any] = [stage(x)]
    if pos.last:
        held.append(loss(held[0] if pos.pp > 1 else held.pop(), io.tokens))

    def backward() -> None:
        out = held.pop()
        if pos.last:
            out.backward()
        else:
            out.backward(io.grads[i])
        del out
        held.clear()
        if isinstance(x, Tensor) and x.requires_grad:
            x.grad = None  # sent to the previous stage, then dropped

    return backward


def repeat_tolerant(tracker_cls: type) -> type:
    """``tracker_cls`` (torch's MemTracker) counting a module called several times in one
    step (a pipeline stage runs once per micro-batch): MemTracker refuses a second top-level
    call of a module; its memory count (the peak) does not depend on that per-module record.

    It also counts a split backward (the zero-bubble schedules: trace_ops.py). Its module
    tracker hooks each module's inputs to learn when the module's backward ends, waiting for
    all of them (``register_multi_grad_hook``'s "all"), which fails and leaks there: torch's
    engine cannot say whether it will reach a leaf input (a stage's receive buffer) inside
    ``autograd.grad``, which the input-gradient step runs, and raises; and the hook's closure
    holds the inputs' autograd nodes, a reference cycle, so nodes the input step kept with
    their saved tensors outlive the step until Python's garbage collector happens to run
    (Llama's ZB1P rank 0 measured 30.31 MB with it, 27.86 MB without; the trace, collected
    at other moments, +5.1 %). While tracking, the hook fires at the first gradient ("any":
    no cycle): that moves only the per-module record, never the count."""

    from torch.distributed._tools import mod_tracker

    class Tracker(tracker_cls):
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:
                return

        def __enter__(self) -> Any:
            self._register = mod_tracker.register_multi_grad_hook
            mod_tracker.register_multi_grad_hook = _first_grad(self._register)
            return super().__enter__()

        def __exit__(self, *args: Any) -> None:
            super().__exit__(*args)
            mod_tracker.register_multi_grad_hook = self._register

    return Tracker


def _first_grad(register: Callable[..., Any]) -> Callable[..., Any]:
    def hook(tensors: Any, fn: Callable[..., None], *, mode: str = "all") -> Any:
        return register(tensors, fn, mode="any")

    return hook


def measured_stage_peak(pipe: Any, optimizer: torch.optim.Optimizer, tokens: Tensor) -> float:
    """A real pipeline stage's peak bytes in one steady training step on ``tokens`` (inputs
    ``[:, :-1]``, targets ``[:, 1:]``), counted by torch's MemTracker over the stage's modules,
    the optimizer, the batch and the receive buffers: what a traced stage is checked against.
    A first, untracked step creates the optimizer's states and the receive buffers."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from meshrun.parallel.pp.pipeline import pipeline_step

    def step() -> None:
        pipeline_step(pipe, tokens[:, :-1], tokens[:, 1:])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = repeat_tolerant(MemTracker)()  # the stage runs once per micro-batch
    tracker.track_external(*pipe.modules, optimizer, tokens, *_recv_buffers(pipe))
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")
    return float(next(iter(peak.values()))["Total"])


def _recv_buffers(pipe: Any) -> list[Tensor]:
    """The stage's receive buffers (activations from the previous stage, gradients from the
    next), allocated by torch's PipelineStage at the first step and kept for the run."""
    stages = getattr(pipe.schedule, "_stages", None) or [pipe.schedule._stage]
    out: list[Tensor] = []
    for stage in stages:
        for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
            out += [i.buffer for i in infos if getattr(i, "buffer", None) is not None]
    return out


__all__ = [
    "RankPosition",
    "StageIO",
    "StagePosition",
    "interleaved_order",
    "interleaved_positions",
    "measured_stage_peak",
    "output_meta",
    "repeat_tolerant",
    "run_schedule",
    "stage_io",
    "stage_module",
    "torch_rank_order",
    "traced_positions",
]
