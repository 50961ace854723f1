"""ParallelDims: the validated degrees of the layout, and the one named DeviceMesh built from them.

The mesh dims are ``pp, dp_replicate, dp_shard, cp, tp`` (outermost first). Ranks are numbered
node by node, so the innermost dim holds neighbouring ranks: ``tp`` (the chattiest, an all-reduce
per layer) stays inside a node, then ``cp`` (two all-to-alls per attention layer), then
``dp_shard`` (FSDP's all-gathers), while ``dp_replicate`` and ``pp`` may cross nodes. Only dims of
size > 1 enter the mesh, plus ``dp_shard`` of size 1 when the mesh would otherwise have no
data-parallel dim. Data loading uses the flattened ``dp`` view (dp_replicate x dp_shard): the cp
ranks of one dp rank read the same batch, each its own slice of the sequence. FSDP shards over
``dp_shard`` (HSDP: the 2-D ``(dp_replicate, dp_shard)`` sub-mesh), under cp over the flattened
``dp_shard_cp`` (cp ranks hold the same parameters), and DDP and the loss reduce over ``dp_cp``
(dp x cp): each cp rank's loss is its slice's mean, so their mean is the sequence's;
tensor parallel uses ``tp``.

``ep`` (expert parallel) is no dim of this mesh: it borrows groups of ``ep`` consecutive
data-parallel ranks (a dp index ``i`` is in ep group ``i // ep``). :func:`build_ep_mesh` builds
the second mesh its layers, gradients and checkpoints use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshrun.config import ParallelConfig, resolve_mesh_dims
from meshrun.config.world import show_dims

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1  # expert parallel: borrowed from the dp ranks, not a mesh dim
    cp: int = 1  # last, with a default: the positional (pp, dp_replicate, dp_shard, tp) holds

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve ``dp_shard=-1`` and check the product against the world (ConfigError)."""
        return cls(**resolve_mesh_dims(cfg, world_size), ep=cfg.ep)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh | None) -> ParallelDims:
        """The degrees of a mesh built by :func:`build_mesh` (a 1-D ``dp`` mesh is dp_shard)."""
        if mesh is None:
            return cls(1, 1, 1, 1)
        names = mesh.mesh_dim_names or ()
        if names == ("dp",):
            return cls(1, 1, mesh.size(), 1)
        sizes = dict(zip(names, mesh.shape, strict=True))
        return cls(**{n: sizes.get(n, 1) for n in MESH_DIMS})

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are consumed per micro-step."""
        return self.dp_replicate * self.dp_shard

    def active(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in MESH_DIMS if getattr(self, n) > 1}

    def dp_rank(self, rank: int) -> int:
        """This rank's index among the data-parallel ranks (row-major mesh layout)."""
        return (rank // (self.tp * self.cp)) % self.dp

    def describe(self) -> str:
        """``pp=1 x dp_replicate=1 x dp_shard=2 x tp=2``: every dim (``cp`` only when > 1), for
        messages and logs (and `` (ep=2)`` when expert parallel borrows from the dp ranks)."""
        shown = show_dims({n: getattr(self, n) for n in MESH_DIMS})
        return shown + (f" (ep={self.ep})" if self.ep > 1 else "")


def mesh_dims(dims: ParallelDims) -> dict[str, int]:
    """The dims that enter the mesh, outermost first (see the module docstring)."""
    active = dims.active()
    if not {"dp_replicate", "dp_shard"} & set(active) or ("cp" in active and dims.dp_shard == 1):
        # Keep one data-parallel dim (of size 1) so that the ``dp`` view always exists, and
        # dp_shard under cp: FSDP2 shards over the flattened (dp_shard, cp).
        active = {n: getattr(dims, n) for n in MESH_DIMS if n in active or n == "dp_shard"}
    return active


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """Build the named mesh. A pure data-parallel layout over one dim is the 1-D mesh
    ``("dp",)``; otherwise the active dims, with the ``dp`` view flattened from the dp dims."""
    active = mesh_dims(dims)
    if list(active) in (["dp_shard"], ["dp_replicate"]):
        return init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("dp",))
    names = tuple(active)
    mesh = init_device_mesh(device_type, tuple(active.values()), mesh_dim_names=names)
    dp_names = tuple(n for n in names if n.startswith("dp_"))
    mesh[dp_names]._flatten("dp")  # the view data loading and loss reduction use
    if dims.cp > 1:  # FSDP2's shards and DDP's (and the loss's) reduction span the cp ranks
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh[tuple([*dp_names, "cp"])]._flatten("dp_cp")
    return mesh


def dp_cp_group_name(mesh: DeviceMesh) -> str:
    """The dim gradients and losses are averaged over: ``dp_cp`` under context parallel (each
    cp rank's loss is the mean over its slice of the sequence), else ``dp``."""
    return "dp_cp" if "cp" in (mesh.mesh_dim_names or ()) else "dp"


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: ``dp_shard``, or ``(dp_replicate, dp_shard)`` for HSDP."""
    names = mesh.mesh_dim_names or ()
    if names == ("dp",):
        return mesh
    shard = "dp_shard_cp" if "cp" in names else "dp_shard"  # cp ranks share the shards
    if "dp_replicate" in names and "dp_shard" in names:
        return mesh["dp_replicate", shard]
    if "cp" in names:
        return mesh[shard]
    if "dp_shard" not in names:
        raise ValueError(f"mesh {names} has no dp_shard dim to shard over")
    return mesh["dp_shard"]


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        raise ValueError(f"mesh {names} has no tp dim")
    return mesh["tp"]


EP_DIMS = ("pp", "ep", "ep_replicate", "tp")


def ep_rank_grid(dims: ParallelDims) -> torch.Tensor:
    """The world's ranks as ``(pp, ep, ep_replicate, tp)``: dp index ``r * ep + e`` is ep rank
    ``e`` of ep group ``r``, so an ep group is ``ep`` consecutive dp ranks (on one node where
    the dp ranks are) and ``ep_replicate`` joins the dp/ep ranks that hold the same experts."""
    if dims.dp % dims.ep:
        raise ValueError(f"ep={dims.ep} does not divide the data-parallel size {dims.dp}")
    grid = torch.arange(dims.world_size).reshape(dims.pp, dims.dp // dims.ep, dims.ep, dims.tp)
    return grid.permute(0, 2, 1, 3)


def build_ep_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The expert-parallel mesh ``(pp, ep, ep_replicate, tp)`` over the same ranks as the
    named mesh (a collective: every rank calls it). ``mesh["ep"]`` dispatches tokens,
    ``mesh["ep_replicate"]`` reduces the experts' gradients, ``mesh["ep", "ep_replicate"]``
    holds the expert tensors of a checkpoint (``Shard(0)`` on both: ep first)."""
    return DeviceMesh(device_type, ep_rank_grid(dims), mesh_dim_names=EP_DIMS)
