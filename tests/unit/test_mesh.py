"""ParallelDims, the pure part of the mesh: resolution from the config and rank arithmetic."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from meshrun.config import ConfigError, ParallelConfig
from meshrun.runtime.mesh import MESH_DIMS, ParallelDims

pytestmark = pytest.mark.timeout(10)


def test_from_config_fills_dp_shard_with_the_rest_of_the_world() -> None:
    dims = ParallelDims.from_config(ParallelConfig(), 8)
    assert dims == ParallelDims(pp=1, dp_replicate=1, dp_shard=8, tp=1)
    assert dims.world_size == 8
    assert dims.dp == 8


def test_from_config_with_replicate_and_tp() -> None:
    dims = ParallelDims.from_config(ParallelConfig(dp_replicate=2, tp=2), 16)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == (1, 2, 4, 2)
    assert dims.dp == 8
    assert dims.world_size == 16


def test_from_config_rejects_a_product_other_than_the_world() -> None:
    with pytest.raises(ConfigError, match="dp_shard=3"):
        ParallelDims.from_config(ParallelConfig(dp_shard=3), 2)


def test_active_lists_dims_above_one_in_mesh_order() -> None:
    assert ParallelDims(1, 1, 1, 1).active() == {}
    assert ParallelDims(1, 1, 4, 1).active() == {"dp_shard": 4}
    active = ParallelDims(pp=2, dp_replicate=2, dp_shard=1, tp=4).active()
    assert active == {"pp": 2, "dp_replicate": 2, "tp": 4}
    assert list(active) == [d for d in MESH_DIMS if d in active]  # outermost first


def test_dp_rank_without_tp_is_the_rank() -> None:
    dims = ParallelDims(1, 1, 4, 1)
    assert [dims.dp_rank(r) for r in range(4)] == [0, 1, 2, 3]


def test_dp_rank_with_tp_groups_neighbouring_ranks() -> None:
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=4, tp=2)
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_dp_rank_matches_the_row_major_mesh() -> None:
    dims = ParallelDims(pp=2, dp_replicate=2, dp_shard=3, tp=2)
    coords = itertools.product(range(2), range(2), range(3), range(2))  # pp, dpr, dps, tp
    for rank, (_, dpr, dps, _) in enumerate(coords):
        assert dims.dp_rank(rank) == dpr * 3 + dps, rank
    # every dp index appears once per (pp, tp) pair
    counts = [[dims.dp_rank(r) for r in range(24)].count(i) for i in range(dims.dp)]
    assert counts == [4] * 6


def test_parallel_dims_is_frozen() -> None:
    dims = ParallelDims(1, 1, 2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.tp = 2  # type: ignore[misc]


def test_ep_is_borrowed_from_the_dp_ranks() -> None:
    dims = ParallelDims.from_config(ParallelConfig(ep=2), 4)
    assert (dims.dp, dims.ep, dims.world_size) == (4, 2, 4)  # ep does not multiply the world
    assert dims.describe() == "pp=1 x dp_replicate=1 x dp_shard=4 x tp=1 (ep=2)"
    assert ParallelDims(1, 1, 4, 1).describe() == "pp=1 x dp_replicate=1 x dp_shard=4 x tp=1"


def test_ep_groups_are_consecutive_dp_ranks() -> None:
    from meshrun.runtime.mesh import ep_rank_grid

    grid = ep_rank_grid(ParallelDims(pp=1, dp_replicate=1, dp_shard=4, tp=1, ep=2))
    # (pp, ep, ep_replicate, tp): ep groups [0, 1] and [2, 3]; replicas [0, 2] and [1, 3].
    assert grid[0, :, :, 0].T.tolist() == [[0, 1], [2, 3]]
    assert grid[0, :, :, 0].tolist() == [[0, 2], [1, 3]]
    # With tp, the ep group of rank 0 is the dp ranks 0 and 1 at tp coordinate 0: ranks 0, 2.
    grid = ep_rank_grid(ParallelDims(pp=1, dp_replicate=1, dp_shard=2, tp=2, ep=2))
    assert grid[0, :, 0, 0].tolist() == [0, 2]
    assert grid[0, :, 0, 1].tolist() == [1, 3]


@pytest.mark.parametrize(
    ("fields", "world", "match"),
    [
        ({"ep": 3}, 4, r"parallel.ep = 3 does not divide .* = 4 .* choose ep in \[1, 2, 4\]"),
        ({"ep": 2, "zero": 1}, 4, "parallel.ep = 2 with parallel.zero = 1"),
        ({"ep": 2, "pp": 2}, 4, "parallel.ep = 2 with parallel.pp = 2 is not supported"),
    ],
)
def test_ep_refusals_name_the_key_and_the_allowed_values(
    fields: dict[str, int], world: int, match: str
) -> None:
    from meshrun.config import check_layout, resolve_mesh_dims

    cfg = ParallelConfig(**fields)
    with pytest.raises(ConfigError, match=match):
        check_layout(cfg, resolve_mesh_dims(cfg, world))
