"""Context parallel's config: ``parallel.cp`` is a mesh dim between dp_shard and tp, the cp
ranks of one data-parallel rank share its data, and the layouts it does not compose with are
refused before any process starts, each error naming the keys and the fix."""

from __future__ import annotations

import pytest

from meshrun.config import ConfigError, ParallelConfig, load_config, validate_for_world
from meshrun.runtime.mesh import MESH_DIMS, ParallelDims, mesh_dims

pytestmark = pytest.mark.timeout(10)


def test_cp_is_a_mesh_dim_between_dp_shard_and_tp() -> None:
    assert MESH_DIMS == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    dims = ParallelDims.from_config(ParallelConfig(cp=2), 8)
    assert (dims.dp_shard, dims.cp, dims.dp, dims.world_size) == (4, 2, 4, 8)
    assert dims.describe() == "pp=1 x dp_replicate=1 x dp_shard=4 x cp=2 x tp=1"
    assert ParallelDims(1, 1, 4, 1).describe() == "pp=1 x dp_replicate=1 x dp_shard=4 x tp=1"


def test_cp_ranks_of_one_data_parallel_rank_share_its_data() -> None:
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, tp=1, cp=2)
    assert [dims.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]


def test_the_mesh_keeps_dp_shard_under_cp_for_fsdp_to_shard_over() -> None:
    assert mesh_dims(ParallelDims(1, 1, 1, 1, cp=2)) == {"dp_shard": 1, "cp": 2}
    dims = ParallelDims(pp=1, dp_replicate=2, dp_shard=1, tp=1, cp=2)
    assert mesh_dims(dims) == {"dp_replicate": 2, "dp_shard": 1, "cp": 2}


def test_cp_counts_in_the_product() -> None:
    cfg = load_config(None, [("parallel.cp", "3")])
    with pytest.raises(ConfigError, match=r"x cp = 1 x 1 x 1 x 3 = 3 does not divide"):
        validate_for_world(cfg, 4)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"pp": 2}, "parallel.pp = 2"),
        ({"tp": 2}, "parallel.tp = 2"),
        ({"zero": 1}, "parallel.zero = 1"),
    ],
)
def test_refused_compositions_name_the_keys_and_the_fix(
    overrides: dict[str, int], named: str
) -> None:
    cfg = load_config(None, [(f"parallel.{k}", str(v)) for k, v in {"cp": 2, **overrides}.items()])
    with pytest.raises(ConfigError) as info:
        validate_for_world(cfg, 8)
    msg = str(info.value)
    assert "parallel.cp = 2" in msg and named in msg and "parallel.cp=1" in msg, msg


def test_zero3_shards_over_dp_shard_times_cp() -> None:
    cfg = load_config(None, [("parallel.cp", "2"), ("parallel.zero", "3")])
    assert validate_for_world(cfg, 2) == {
        "pp": 1,
        "dp_replicate": 1,
        "dp_shard": 1,
        "cp": 2,
        "tp": 1,
    }
