"""Invalid layouts are rejected before any process starts, each error naming the dims; the
tensor-parallel plan and FSDP's wrapping predicate, checked without a process group."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshrun.config import ConfigError, ParallelConfig, load_config, validate_for_world
from meshrun.demo.model import GPT, GPTConfig, demo_config
from meshrun.parallel import (
    apply_ac,
    build_optimizer,
    check_optimizer,
    default_tp_plan,
    is_block,
    parallelize,
)
from meshrun.parallel.ac import is_checkpointed
from meshrun.parallel.pp.pipeline import split_blocks
from meshrun.parallel.report import describe_layout
from meshrun.parallel.tp import check_tp_plan
from meshrun.runtime.mesh import ParallelDims, mesh_dims

pytestmark = pytest.mark.timeout(30)


def rejected(world: int, **overrides: object) -> str:
    cfg = load_config(None, [(f"parallel.{k}", str(v)) for k, v in overrides.items()])
    with pytest.raises(ConfigError) as info:
        validate_for_world(cfg, world)
    return str(info.value)


def test_product_other_than_the_world_names_every_dim() -> None:
    msg = rejected(4, dp_shard=2, tp=4)
    assert "pp=1 x dp_replicate=1 x dp_shard=2 x tp=4 = 8" in msg and "world size is 4" in msg


def test_degrees_that_do_not_divide_the_world_are_named() -> None:
    assert "dp_replicate x tp x pp = 1 x 3 x 1 = 3" in rejected(4, tp=3)


def test_zero_without_a_dp_shard_dim_is_rejected() -> None:
    msg = rejected(4, zero=3, tp=4)
    assert "parallel.zero = 3" in msg and "dp_shard=1" in msg and "tp=4" in msg
    assert "dp_shard=1" in rejected(2, zero=1, dp_replicate=2, dp_shard=1)


def test_tp_with_zero1_or_without_a_dp_shard_dim_is_rejected() -> None:
    msg = rejected(4, tp=2, zero=1)
    assert "parallel.tp = 2" in msg and "parallel.zero = 1" in msg
    assert "dp_shard=2" in msg and "zero=2 or 3" in msg
    msg = rejected(4, tp=2, dp_replicate=2)  # DDP over dp_replicate cannot take DTensors
    assert "dp_replicate=2 x dp_shard=1 x tp=2" in msg


def test_tp_with_ddp_runs_as_zero3_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    from meshrun.parallel import data_parallel_stage

    assert validate_for_world(load_config(None, [("parallel.tp", "2")]), 4)["dp_shard"] == 2
    with caplog.at_level("WARNING", logger="meshrun"):
        assert data_parallel_stage(ParallelConfig(tp=2), ParallelDims(1, 1, 2, 2)) == 3
    assert "parallel.zero = 0 (DDP) cannot take tensor-parallel parameters" in caplog.text
    assert data_parallel_stage(ParallelConfig(tp=2), ParallelDims(1, 1, 1, 2)) == 0
    assert data_parallel_stage(ParallelConfig(zero=2, tp=2), ParallelDims(1, 1, 2, 2)) == 2


@pytest.mark.parametrize(
    ("world", "overrides", "dims"),
    [
        (4, {"zero": 3}, (1, 1, 4, 1)),
        (4, {"zero": 3, "dp_replicate": 2}, (1, 2, 2, 1)),
        (4, {"zero": 3, "tp": 2}, (1, 1, 2, 2)),
        (2, {"tp": 2}, (1, 1, 1, 2)),
        (4, {"zero": 1}, (1, 1, 4, 1)),
    ],
)
def test_valid_layouts_pass(world: int, overrides: dict[str, int], dims: tuple[int, ...]) -> None:
    cfg = load_config(None, [(f"parallel.{k}", str(v)) for k, v in overrides.items()])
    assert tuple(validate_for_world(cfg, world).values()) == dims


def test_mesh_dims_keep_tp_innermost_and_always_a_dp_dim() -> None:
    assert list(mesh_dims(ParallelDims(1, 2, 2, 2))) == ["dp_replicate", "dp_shard", "tp"]
    assert mesh_dims(ParallelDims(1, 1, 1, 2)) == {"dp_shard": 1, "tp": 2}  # dp view exists
    assert mesh_dims(ParallelDims(1, 1, 1, 1)) == {"dp_shard": 1}


def tiny() -> GPT:
    return GPT(demo_config("tiny"))


def test_default_tp_plan_of_the_demo_gpt() -> None:
    plan = default_tp_plan(tiny())
    cols = sorted(k for k, v in plan.items() if isinstance(v, ColwiseParallel))
    rows = sorted(k for k, v in plan.items() if isinstance(v, RowwiseParallel))
    assert cols == [
        f"blocks.{i}.{m}" for i in (0, 1) for m in ("attn.k", "attn.q", "attn.v", "mlp.up")
    ]
    assert rows == [f"blocks.{i}.{m}" for i in (0, 1) for m in ("attn.proj", "mlp.down")]


def test_no_plan_found_is_an_error_that_says_what_to_pass() -> None:
    with pytest.raises(ConfigError, match="tp_plan="):
        default_tp_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_tp_must_divide_the_heads() -> None:
    model = GPT(GPTConfig(seq_len=8, n_layer=1, n_head=3, d_model=48))
    with pytest.raises(ConfigError) as info:
        check_tp_plan(model, default_tp_plan(model), 2)
    assert "parallel.tp = 2 does not divide blocks.0.attn.n_head = 3" in str(info.value)
    check_tp_plan(model, default_tp_plan(model), 3)  # 3 heads over 3 ranks is fine


def test_tp_must_divide_the_split_features_of_a_user_plan() -> None:
    model = GPT(GPTConfig(seq_len=8, n_layer=1, n_head=4, d_model=32, ffn_mult=3))
    plan = {"blocks.*.mlp.up": ColwiseParallel(), "blocks.*.mlp.down": RowwiseParallel()}
    check_tp_plan(model, plan, 4)  # 96 hidden features over 4 ranks
    with pytest.raises(ConfigError, match=r"blocks\.0\.mlp\.up\.out_features = 96"):
        check_tp_plan(model, plan, 64)


def test_default_fsdp_units_are_the_blocks() -> None:
    names = [n for n, m in tiny().named_modules() if n and is_block(n, m)]
    assert names == ["blocks.0", "blocks.1"]


def test_cpu_offload_on_cpu_is_an_error_not_a_silent_no_op() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.cpu_offload = true needs CUDA"):
        parallelize(tiny(), None, ParallelConfig(zero=3, cpu_offload=True), torch.device("cpu"))


def test_sequence_parallel_without_tp_is_rejected() -> None:
    msg = rejected(2, sequence_parallel="true")
    assert "parallel.sequence_parallel = true" in msg and "tp=1" in msg


def test_fsdp_precision_keys_under_ddp_are_errors() -> None:
    # param_dtype runs under DDP as autocast (test_layout_precision.py); reduce_dtype cannot.
    cfg = ParallelConfig(zero=0, reduce_dtype="bfloat16")
    with pytest.raises(
        ConfigError, match=r"parallel\.reduce_dtype = 'bfloat16'.*parallel\.zero = 0"
    ):
        parallelize(tiny(), None, cfg, torch.device("cpu"))


def test_a_plain_optimizer_under_zero1_is_an_error() -> None:
    model = tiny()
    opt = build_optimizer(model, torch.optim.SGD, None, ParallelConfig(zero=1), lr=0.1)
    assert type(opt) is torch.optim.SGD  # one process: nothing to shard
    with pytest.raises(ConfigError, match=r"run\.optimizer\(model, torch\.optim\.SGD"):
        check_optimizer(opt, ParallelConfig(zero=1), dp=2)
    check_optimizer(opt, ParallelConfig(zero=0), dp=2)


def test_activation_checkpointing_wraps_every_kth_block_and_keeps_state_dict_keys() -> None:
    model = GPT(GPTConfig(seq_len=8, n_layer=4, n_head=2, d_model=16))
    keys, names = list(model.state_dict()), [n for n, _ in model.named_modules()]
    assert apply_ac(model, 2) == 2
    wrapped = [n for n, m in model.named_modules() if is_checkpointed(m)]
    assert wrapped == ["blocks.1", "blocks.3"]
    assert list(model.state_dict()) == keys  # checkpoints do not depend on the setting
    assert [n for n, _ in model.named_modules()] == names  # nor the user's own names


def test_the_start_up_description_of_a_one_process_layout() -> None:
    text = describe_layout(tiny(), None, ParallelConfig(), zero=0)
    assert "layout: pp=1 x dp_replicate=1 x dp_shard=1 x tp=1 | ZeRO-0" in text
    assert "this rank holds 0.51 MiB of 0.51 MiB parameters" in text  # 533,760 bytes


def test_pipeline_layouts_are_checked() -> None:
    assert "parallel.pp_microbatches = 1 is fewer than the pp = 2" in rejected(
        2, pp=2, pp_microbatches=1
    )
    # PP composes with TP (+ loss parallel), DDP, ZeRO-1 and FSDP2 on the other dims
    # (tests/dist/test_layouts_pp.py, tests/dist/test_pp_zero1.py)
    layouts = ({"tp": 2}, {"tp": 2, "loss_parallel": "true"}, {"zero": 0}, {"zero": 1})
    for layout in (*layouts, {"zero": 2}, {"zero": 3}):
        cfg = load_config(None, [(f"parallel.{k}", str(v)) for k, v in {"pp": 2, **layout}.items()])
        assert validate_for_world(cfg, 4)["pp"] == 2, layout
    assert "needs FSDP2" in rejected(8, pp=2, tp=2, zero=1)  # ZeRO-1 cannot take DTensors
    assert "has tp=1" in rejected(4, pp=2, loss_parallel="true")
    assert tuple(validate_for_world(load_config(None, [("parallel.pp", "2")]), 2).values()) == (
        2,
        1,
        1,
        1,
    )
    cfg = load_config(None, [("parallel.pp", "2"), ("parallel.pp_microbatches", "3")])
    with pytest.raises(ConfigError, match=r"data\.micro_batch = 8 does not split"):
        validate_for_world(cfg, 2)


def test_zero_bubble_schedules_are_checked_and_placed() -> None:
    from meshrun.parallel.pp.placement import rank_of_stage, stage_ids

    msg = rejected(2, pp=2, pp_schedule="zbv", pp_virtual_stages=3)
    assert "parallel.pp_schedule = zbv holds exactly 2 stages per rank" in msg
    assert "parallel.pp_virtual_stages = 3" in msg and "pp_virtual_stages=2" in msg
    msg = rejected(2, pp=2, pp_schedule="zb1p", pp_microbatches=5)
    assert "parallel.pp_microbatches = 5 is not a multiple of 2" in msg
    assert "choose pp_microbatches in [2, 3, 4, 6, 8]" in msg
    msg = rejected(2, pp=2, pp_schedule="dualpipev", pp_microbatches=2)
    assert "set pp_microbatches >= 4" in msg
    with pytest.raises(ConfigError, match=r"pp_schedule = 'zbx' is not allowed: .*'dualpipev'"):
        load_config(None, [("parallel.pp_schedule", "zbx")])
    for schedule, micro in (("zb1p", 4), ("zbv", 2), ("dualpipev", 4)):
        over = {"pp": 2, "pp_schedule": schedule, "pp_microbatches": micro}
        cfg = load_config(None, [(f"parallel.{k}", str(v)) for k, v in over.items()])
        cfg.data.micro_batch = 8
        assert validate_for_world(cfg, 2)["pp"] == 2, schedule
    # V placement: rank r holds stages r and 2 pp - 1 - r; looped: r, r + pp, ...
    v = ParallelConfig(pp=4, pp_schedule="zbv")
    assert [stage_ids(r, v) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [rank_of_stage(s, v) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    looped = ParallelConfig(pp=2, pp_schedule="zb1p", pp_virtual_stages=3)
    assert stage_ids(1, looped) == [1, 3, 5] and rank_of_stage(5, looped) == 1


def test_pipeline_stages_split_blocks_evenly_and_not_beyond_the_blocks() -> None:
    assert split_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert split_blocks(5, 2) == [range(0, 3), range(3, 5)]
    with pytest.raises(ConfigError, match="4 pipeline stages, but the model has only 2 blocks"):
        split_blocks(2, 4)
