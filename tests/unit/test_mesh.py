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
