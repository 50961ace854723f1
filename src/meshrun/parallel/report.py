"""The start-up description of a layout: the mesh, which ranks form each group, and the bytes of
model state this rank holds (measured from its local tensors, not predicted)."""

from __future__ import annotations

import logging
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from meshrun.config import ParallelConfig
from meshrun.parallel.kinds import is_dtensor, is_zero_redundancy
from meshrun.runtime.mesh import ParallelDims


def local_param_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of parameters on this rank, bytes of the whole model): local shards of DTensors."""
    params = list(model.parameters())
    return sum(_local_bytes(p) for p in params), sum(p.numel() * p.element_size() for p in params)


def rank_groups(mesh: DeviceMesh) -> list[str]:
    """For each mesh dim, the ranks that communicate along it, e.g. ``tp: [0, 1] [2, 3]``."""
    names = mesh.mesh_dim_names or ()
    # The planner's trace (parallel/memory_trace.py) runs parallelize under FakeTensorMode: the mesh's
    # rank tensor stays a real one, read outside the fake mode.
    out = []
    with unset_fake_temporarily():
        ranks = mesh.mesh
        for i, name in enumerate(names):
            groups = ranks.movedim(i, -1).reshape(-1, ranks.shape[i]).tolist()
            out.append(f"{name}: " + " ".join(str(g) for g in groups))
    return out


def describe_layout(
    model: nn.Module, mesh: DeviceMesh | None, cfg: ParallelConfig, zero: int
) -> str:
    """A few lines for the start-up log (rank 0 prints them)."""
    dims = ParallelDims.from_mesh(mesh)
    local, whole = local_param_bytes(model)
    sharded_optim = zero >= 1 and dims.dp * dims.cp > 1
    lines = [
        layout_header(dims, cfg, zero),
        f"this rank holds {local / 2**20:.2f} MiB of {whole / 2**20:.2f} MiB parameters, "
        "as many gradient bytes (gradients are laid out like the parameters), optimizer state "
        + (f"~1/{dims.dp * dims.cp}" if sharded_optim else "for all its parameters"),
    ]
    if mesh is not None:
        lines += ["rank groups: " + " | ".join(rank_groups(mesh))]
    return "\n  ".join(lines)


def layout_header(dims: ParallelDims, cfg: ParallelConfig, zero: int) -> str:
    """The first line: the mesh, the technique and what each data-parallel rank holds."""
    return (
        f"layout: {_dims_text(dims, zero)} | ZeRO-{zero}{_technique(dims, zero)} | "
        f"params {cfg.param_dtype}, "
        f"gradient reduction {cfg.reduce_dtype if zero >= 2 else 'float32'}"
        + (f", DDP hook {cfg.ddp_comm_hook}" if zero < 2 and dims.dp > 1 else "")
    )


def _dims_text(dims: ParallelDims, zero: int) -> str:
    # DDP's data-parallel dim replicates (the 1-D mesh is named dp): calling it dp_shard, as
    # the mesh bookkeeping does, would say the model is sharded.
    if zero >= 2 or dims.dp == 1 or dims.dp_replicate > 1:
        return dims.describe()
    cp = f" x cp={dims.cp}" if dims.cp > 1 else ""
    return f"pp={dims.pp} x dp={dims.dp} (replicated){cp} x tp={dims.tp}"


def _technique(dims: ParallelDims, zero: int) -> str:
    """What each data-parallel rank holds, in words (under cp, DDP and FSDP2 span dp x cp)."""
    n = dims.dp * dims.cp
    if n == 1:
        return ""
    return {
        0: f" = DDP over {n} ranks: each holds a whole replica (parameters, gradients, "
        "optimizer state)",
        1: f" = DDP + ZeRO-1 over {n} ranks: parameters and gradients replicated, "
        "optimizer state sharded",
        2: f" = FSDP2 over {n} ranks: parameters, gradients and optimizer state sharded "
        "(parameters stay gathered from forward to backward)",
        3: f" = FSDP2 over {n} ranks: parameters, gradients and optimizer state sharded",
    }.get(zero, "")


def _local_bytes(t: Tensor) -> int:
    local = t.to_local() if is_dtensor(t) else t
    return local.numel() * local.element_size()


def state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes this rank holds for ``optimizer``'s
    parameters, measured from its local tensors (DTensor shards); call it between the
    optimizer's step and ``zero_grad``, when the gradients and the state both exist."""
    params = {id(p): p for g in optimizer.param_groups for p in g["params"]}.values()
    inner = optimizer.optim if is_zero_redundancy(optimizer) else optimizer
    state = [t for s in inner.state.values() for t in s.values() if isinstance(t, Tensor)]
    grads = [p.grad for p in params if p.grad is not None]
    return (
        sum(_local_bytes(p) for p in params),
        sum(_local_bytes(g) for g in grads),
        sum(_local_bytes(t) for t in state),
    )


def state_table(rows: list[tuple[str, int, int, int]]) -> str:
    """The start-up table: one line per rank (``(host, params, grads, optimizer)`` bytes)."""
    mib = 2**20
    lines = ["model state per rank after the first step (MiB; measured from local tensors):"]
    lines.append(f"  {'rank':>4} {'host':<16} {'params':>9} {'grads':>9} {'optimizer':>9}")
    for rank, (host, p, g, o) in enumerate(rows):
        lines.append(f"  {rank:>4} {host[:16]:<16} {p / mib:>9.2f} {g / mib:>9.2f} {o / mib:>9.2f}")
    return "\n".join(lines)


def log_state_table(optimizer: torch.optim.Optimizer, log: logging.Logger) -> None:
    """Gather every rank's :func:`state_bytes` (once, at the first step) and log the table on
    rank 0: which rank holds what, as the layout really placed it."""
    mine = (socket.gethostname(), *state_bytes(optimizer))
    rows: list[Any] = [mine]
    if dist.is_initialized():
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(state_table(rows))
