"""ParallelDims: the validated degrees of the layout, and the one named DeviceMesh built from them.

The mesh dims are ``pp, dp_replicate, dp_shard, tp`` (outermost first, so tp stays inside a
node when ranks are numbered node by node). Only dims of size > 1 enter the mesh; data
loading and loss reduction use the flattened ``dp`` view (dp_replicate x dp_shard).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshrun.config import ParallelConfig, resolve_mesh_dims

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve ``dp_shard=-1`` and check the product against the world (ConfigError)."""
        return cls(**resolve_mesh_dims(cfg, world_size))

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are consumed per micro-step."""
        return self.dp_replicate * self.dp_shard

    def active(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in MESH_DIMS if getattr(self, n) > 1}

    def dp_rank(self, rank: int) -> int:
        """This rank's index among the data-parallel ranks (row-major mesh layout)."""
        return (rank // self.tp) % self.dp


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """Build the named mesh. A pure data-parallel layout is the 1-D mesh ``("dp",)``."""
    active = dims.active()
    if set(active) <= {"dp_replicate", "dp_shard"}:
        return init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("dp",))
    names = tuple(active)
    mesh = init_device_mesh(device_type, tuple(active.values()), mesh_dim_names=names)
    dp_names = tuple(n for n in names if n.startswith("dp_"))
    if len(dp_names) > 1:
        mesh[dp_names]._flatten("dp")  # the view data loading and loss reduction use
    return mesh
