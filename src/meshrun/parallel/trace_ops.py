"""A pipeline rank with several stages, traced op by op (parallel/memory_trace.py).

The multi-stage schedules (interleaved 1F1B and the zero-bubble ZB1P, ZB-V and DualPipeV) are
traced per rank in the order torch's own schedule class computes for that rank: its
``_calculate_single_rank_operations``, given the sizes it reads (:func:`zero_bubble_order`;
interleaved: trace_stages.interleaved_order). ZB1P's extra step, ``_add_bubbles_to_actions``,
only inserts idle slots, which change no rank's order.

The zero-bubble schedules split a backward in two, as torch's ``PipelineStage`` does with
torch's own functions (torch/distributed/pipelining/_backward.py), which the trace calls:

- I (``BACKWARD_INPUT``): ``stage_backward_input`` computes the input's gradient with the
  graph kept (``retain_graph``) and keeps, per parameter group, the gradients flowing into the
  weights' side of the graph; the stage keeps the chunk's output (the last stage: its loss,
  the logits are dropped) until W. The first stage computes nothing here.
- W (``BACKWARD_WEIGHT``): ``stage_backward_weight`` turns those into the weights' gradients
  and frees the graph; the first stage runs its whole backward (``stage_backward``) here.

So a chunk's activations stay alive from its forward to its W, not its backward; the input's
gradient stays on the receive buffer (I sets ``.grad``, torch clears it at the next step).
DualPipeV runs some backwards whole (B) and pairs a forward with a backward (``OVERLAP_F_B``,
run one after the other). ZB-V and DualPipeV place two stages per rank in a V (rank r holds
stages r and 2 pp - 1 - r, parallel/pp/placement.py): rank 0 holds the first and the last
stage, and at rank pp - 1 a chunk turns back without a send: the forward's output becomes the
next stage's input buffer, the input's gradient the previous stage's gradient buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from meshrun.config import ConfigError

if TYPE_CHECKING:
    from meshrun.config import ParallelConfig
    from meshrun.parallel.trace_stages import Loss, Op, RankPosition, StageIO, StagePosition

# parallel.pp_schedule -> torch's class (parallel/pp/pipeline.py trains with the same ones)
ZERO_BUBBLE = {
    "zb1p": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def zero_bubble_order(
    schedule: str, rank: int, pp: int, v: int, microbatches: int
) -> tuple[Op, ...]:
    """Rank ``rank``'s ops under torch's zero-bubble ``schedule`` with ``v`` stages per rank
    (trace_stages.torch_rank_order: DualPipeV's paired forward and backward as two ops)."""
    from torch.distributed.pipelining import schedules

    from meshrun.parallel.trace_stages import torch_rank_order

    cls = getattr(schedules, ZERO_BUBBLE[schedule])
    return torch_rank_order(cls, rank, pp, v, microbatches)


def order_problem(ops: tuple[Op, ...], stages: list[int], microbatches: int) -> str | None:
    """Why ``ops`` is not one training step of ``stages``: each chunk of each stage once
    forward and once backward (B, or I then W), nothing else; None when it is."""
    seen: dict[tuple[int, int], str] = {}
    for stage, kind, mb in ops:
        if stage not in stages or not 0 <= mb < microbatches:
            return f"an op for stage {stage}, micro-batch {mb}"
        seen[(stage, mb)] = seen.get((stage, mb), "") + kind
    for stage in stages:
        for mb in range(microbatches):
            if seen.get((stage, mb)) not in ("FB", "FIW"):
                return f"stage {stage}, micro-batch {mb} runs {seen.get((stage, mb), 'nothing')!r}"
    return None


def rank_positions(
    n_blocks: int, schedule: str, pp: int, v: int, microbatches: int
) -> list[RankPosition] | None:
    """The traced pp ranks with all their stages for a multi-stage schedule (interleaved with
    v > 1, the zero-bubble ones), or None: the one-stage schedules (trace_stages.py)."""
    from meshrun.parallel.trace_stages import interleaved_positions

    if schedule == "interleaved" and v > 1:
        return interleaved_positions(n_blocks, pp, v, microbatches)
    if schedule in ZERO_BUBBLE:
        return zero_bubble_positions(n_blocks, schedule, pp, v, microbatches)
    return None


def zero_bubble_positions(
    n_blocks: int, schedule: str, pp: int, v: int, microbatches: int
) -> list[RankPosition]:
    """The first and the last pp rank under a zero-bubble schedule, each with its stages
    (looped for zb1p, a V for zbv and dualpipev) and torch's order of their ops. Refused
    (ConfigError, naming the setting and the values that fit) where the run refuses these
    sizes or torch's order is not one whole step for them: never traced as something else."""
    from meshrun.parallel.pp.split import split_blocks
    from meshrun.parallel.trace_stages import RankPosition, StagePosition

    m = max(microbatches, 1)
    v = 2 if schedule in ("zbv", "dualpipev") else v
    _check_schedule(schedule, pp, v, m)  # what torch's constructors refuse
    problem = _order_problem(schedule, pp, v, m)
    if problem is not None:
        fits = [k for k in range(pp, 4 * pp + 1) if _whole_step(schedule, pp, v, k)]
        raise ConfigError(
            f"parallel.pp_schedule = {schedule} with parallel.pp = {pp}, "
            f"pp_virtual_stages = {v} and pp_microbatches = {m}: torch's schedule does not run "
            f"each micro-batch once forward and once backward on every stage ({problem}), so "
            f"its memory cannot be traced; choose pp_microbatches in {fits}"
        )
    sizes = [len(r) for r in split_blocks(n_blocks, pp * v)]
    out = []
    for r in sorted({0, pp - 1}):
        stages = tuple(
            StagePosition(s, pp * v, sizes[s], m, m) for s in _stage_ids(schedule, r, pp, v)
        )
        out.append(RankPosition(r, stages, zero_bubble_order(schedule, r, pp, v, m)))
    return out


def _config(schedule: str, pp: int, v: int, m: int) -> ParallelConfig:
    from meshrun.config import ParallelConfig

    return ParallelConfig(
        pp=pp,
        pp_schedule=schedule,  # type: ignore[arg-type]
        pp_virtual_stages=v,
        pp_microbatches=m,
    )


def _check_schedule(schedule: str, pp: int, v: int, m: int) -> None:
    """The run's own check (config/world.py), which refuses what torch's schedule classes
    refuse when they are built (DualPipeV's fewer chunks than stages, ZB1P's uneven rounds)."""
    from meshrun.config.world import check_pipeline_schedule

    check_pipeline_schedule(_config(schedule, pp, v, m), f"pp={pp}")


def _whole_step(schedule: str, pp: int, v: int, m: int) -> bool:
    try:
        _check_schedule(schedule, pp, v, m)
    except ConfigError:
        return False
    return _order_problem(schedule, pp, v, m) is None


def _stage_ids(schedule: str, rank: int, pp: int, v: int) -> list[int]:
    """The stages rank ``rank`` holds (parallel/pp/placement.py's rule: looped or a V)."""
    from meshrun.parallel.pp.placement import stage_ids

    return stage_ids(rank, _config(schedule, pp, v, pp))


def _order_problem(schedule: str, pp: int, v: int, m: int) -> str | None:
    """The first rank's problem with torch's order for these sizes, if any rank has one."""
    for r in range(pp):
        ops = zero_bubble_order(schedule, r, pp, v, m)
        problem = order_problem(ops, _stage_ids(schedule, r, pp, v), m)
        if problem is not None:
            return f"rank {r}: {problem}"
    return None


# --- running a rank's ops ------------------------------------------------------------------


@dataclass
class _Chunk:
    """One micro-batch on one stage between its forward and its last backward op: what
    torch's stage keeps for it (its input, its output or loss, the split backward's state)."""

    x: Any
    out: Any
    loss: Tensor | None = None
    groups: list[dict[str, Any]] | None = None  # stage_backward_input's, for W


def run_rank_ops(
    stages: list[nn.Module], pos: RankPosition, ios: list[StageIO], loss: Loss
) -> None:
    """The rank's ops in its schedule's order. torch's runtime waits for its sends only at
    the step's end, and each send holds its tensor: every output and input gradient sent
    stays until then."""
    index = {p.index: k for k, p in enumerate(pos.stages)}
    chunks: dict[tuple[int, int], _Chunk] = {}
    sent: list[Tensor] = []
    for stage_id, kind, mb in pos.ops:
        k = index[stage_id]
        ahead = index.get(stage_id + 1)  # the next stage on this rank (a V's turn)
        if kind == "F":
            nxt = ios[ahead] if ahead is not None else None
            chunks[(stage_id, mb)] = _forward(stages[k], pos.stages[k], ios[k], mb, loss, sent, nxt)
            continue
        c = chunks[(stage_id, mb)]
        if kind == "W":
            _weights(stages[k], pos.stages[k], ios[k], mb, c)
        else:
            grad = _backward(stages[k], pos.stages[k], ios[k], mb, c, kind == "I")
            behind = index.get(stage_id - 1)
            if grad is not None and behind is not None:
                ios[behind].grads[mb] = grad  # a V's turn: no send
            elif grad is not None:
                sent.append(grad)
        if kind != "I":
            del chunks[(stage_id, mb)]
    sent.clear()


def _forward(
    stage: nn.Module,
    pos: StagePosition,
    io: StageIO,
    mb: int,
    loss: Loss,
    sent: list[Tensor],
    nxt: StageIO | None,
) -> _Chunk:
    # torch's stage runs on its receive buffer itself (requires_grad set on it)
    x = io.tokens if pos.first else io.acts[mb].requires_grad_()
    out = stage(x)
    c = _Chunk(x, out, loss(out, io.tokens) if pos.last else None)
    if nxt is not None:
        nxt.acts[mb] = out.detach()  # the next stage's input buffer, as torch sets it
    elif not pos.last:
        sent.append(out)
    return c


def _backward(
    stage: nn.Module, pos: StagePosition, io: StageIO, mb: int, c: _Chunk, split: bool
) -> Tensor | None:
    """B (whole) or I (input only; nothing on the first stage); the input's gradient."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input

    grads = None if pos.last else [io.grads[mb]]
    if not split:  # torch passes the last stage's loss as a tensor, the others' outputs as a list
        (grad,) = stage_backward(c.loss if pos.last else [c.out], grads, [c.x])
        return grad
    if pos.first:
        return None  # torch's first stage runs its whole backward at W
    outputs = [c.loss] if c.loss is not None else [c.out]  # the last stage's: its loss
    _, c.groups = stage_backward_input(outputs, grads, [c.x], stage.parameters())
    if pos.last:
        c.out = None  # the logits: torch keeps the loss until W, not them
    return c.x.grad  # stays on the buffer too (torch clears it at the next step)


def _weights(stage: nn.Module, pos: StagePosition, io: StageIO, mb: int, c: _Chunk) -> None:
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_weight

    if pos.first:
        stage_backward([c.out], [io.grads[mb]], [c.x])
    else:
        stage_backward_weight(stage.parameters(), c.groups or [])


__all__ = [
    "ZERO_BUBBLE",
    "order_problem",
    "rank_positions",
    "run_rank_ops",
    "zero_bubble_order",
    "zero_bubble_positions",
]
