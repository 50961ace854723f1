"""The start-up description of a layout: the mesh, which ranks form each group, and the bytes of
model state this rank holds (measured from its local tensors, not predicted)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshrun.config import ParallelConfig
from meshrun.mesh import ParallelDims


def local_param_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of parameters on this rank, bytes of the whole model): local shards of DTensors."""
    local = whole = 0
    for p in model.parameters():
        shard = p.to_local() if isinstance(p, DTensor) else p
        local += shard.numel() * shard.element_size()
        whole += p.numel() * p.element_size()
    return local, whole


def rank_groups(mesh: DeviceMesh) -> list[str]:
    """For each mesh dim, the ranks that communicate along it, e.g. ``tp: [0, 1] [2, 3]``."""
    names = mesh.mesh_dim_names or ()
    ranks = mesh.mesh
    out = []
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
    sharded_optim = zero >= 1 and dims.dp > 1
    lines = [
        f"layout: {dims.describe()} | ZeRO-{zero} | params {cfg.param_dtype}, "
        f"gradient reduction {cfg.reduce_dtype if zero >= 2 else 'float32'}"
        + (f", DDP hook {cfg.ddp_comm_hook}" if zero < 2 and dims.dp > 1 else ""),
        f"this rank holds {local / 2**20:.2f} MiB of {whole / 2**20:.2f} MiB parameters, "
        "as many gradient bytes (gradients have the parameters' shards), optimizer state "
        + (f"~1/{dims.dp}" if sharded_optim else "for all its parameters"),
    ]
    if mesh is not None:
        lines += ["rank groups: " + " | ".join(rank_groups(mesh))]
    return "\n  ".join(lines)
