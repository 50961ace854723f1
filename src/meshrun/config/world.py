"""What needs the world size: the mesh degrees against it, the batch arithmetic, and the
layouts no PyTorch tool runs. The same functions run for every source of a config: the
launcher before it spawns workers, ``config show --world-size``, scale-test, ``init()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from meshrun.config.fault_tolerance import check_diloco_checkpoints, check_diloco_groups
from meshrun.config.fields import ConfigError
from meshrun.config.sections import Config, DataConfig, ParallelConfig, validate


def resolve_mesh_dims(p: ParallelConfig, world_size: int) -> dict[str, int]:
    """Fill in ``dp_shard = -1`` and check that the mesh product equals the world size."""
    fixed = p.dp_replicate * p.tp * p.pp * p.cp
    dp_shard = p.dp_shard
    if dp_shard == -1:
        if world_size % fixed:
            names, values = "dp_replicate x tp x pp", f"{p.dp_replicate} x {p.tp} x {p.pp}"
            if p.cp > 1:
                names, values = f"{names} x cp", f"{values} x {p.cp}"
            raise ConfigError(
                f"parallel: {names} = {values} = {fixed} does not divide the world size "
                f"{world_size}; choose degrees whose product divides it"
            )
        dp_shard = world_size // fixed
    elif dp_shard == 0:
        raise ConfigError("parallel.dp_shard = 0 is not allowed: use -1 (the rest) or >= 1")
    dims = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": dp_shard}
    if p.cp > 1:  # only when used: the mesh order, between dp_shard and tp
        dims["cp"] = p.cp
    dims["tp"] = p.tp
    product = p.pp * p.dp_replicate * dp_shard * p.cp * p.tp
    if product != world_size:
        shown = show_dims(dims)
        raise ConfigError(
            f"parallel: mesh {shown} = {product} processes, but the world size is {world_size}; "
            f"set parallel.dp_shard=-1 or change the degrees so that the product is {world_size}"
        )
    return dims


def show_dims(dims: Mapping[str, int]) -> str:
    """``pp=1 x dp_replicate=1 x dp_shard=2 x tp=1``: every dim, ``cp`` only when it is > 1."""
    return " x ".join(f"{k}={v}" for k, v in dims.items() if k != "cp" or v > 1)


def effective_global_batch(data: DataConfig, dp_size: int) -> int:
    """``data.global_batch``, or ``micro_batch x dp_size`` when it is unset (0)."""
    return data.global_batch or data.micro_batch * dp_size


def grad_accumulation(data: DataConfig, dp_size: int, groups: int = 1) -> int:
    """accumulation = global_batch / (micro_batch x dp_size x groups); an error if it does not
    divide. ``groups`` replica groups of ``dp_size`` data-parallel ranks each share the global
    batch (fault_tolerance.replica_groups). An unset global batch (0) is micro_batch x the
    data-parallel size: accumulation 1, nothing to divide."""
    per_group, dp_size = dp_size, dp_size * groups
    if data.micro_batch < 1 or dp_size < 1:  # a mutated config must not divide by zero
        raise ConfigError(
            f"data.micro_batch = {data.micro_batch} with data-parallel size {dp_size}: both "
            "must be >= 1"
        )
    per_step = data.micro_batch * dp_size
    global_batch = effective_global_batch(data, dp_size)
    if global_batch % per_step:
        ok = [m for m in range(1, global_batch + 1) if global_batch % (m * dp_size) == 0]
        hint = (
            f"micro_batch in {ok[:8]}" if ok else f"a global_batch that is a multiple of {dp_size}"
        )
        across = f" (data-parallel size {per_group} per group x {groups} replica groups)"
        raise ConfigError(
            f"data.global_batch = {global_batch} is not divisible by micro_batch x "
            f"data-parallel size = {data.micro_batch} x {dp_size} = {per_step}; use {hint}"
            + (across if groups > 1 else "")
        )
    return global_batch // per_step


def dp_size_for_world(cfg: Config, world_size: int) -> int:
    """The data-parallel size (dp_replicate x dp_shard) of ``cfg``'s mesh on this world."""
    dims = resolve_mesh_dims(cfg.parallel, world_size)
    return dims["dp_replicate"] * dims["dp_shard"]


def resolve_global_batch(cfg: Config, world_sizes: Sequence[int]) -> str | None:
    """Fill in an unset ``data.global_batch`` (0) in place: micro_batch x the data-parallel
    size of the world, or of the least common multiple of several worlds' sizes, so that one
    number serves each of them (scale-test keeps it across sizes: strong scaling), times the
    replica groups under ``fault_tolerance`` (the worlds are then one group's). Returns the
    line that says what was derived; None when the user set the value (it is kept as is)."""
    if cfg.data.global_batch or not world_sizes:
        return None
    sizes = [dp_size_for_world(cfg, w) for w in world_sizes]
    dp, groups = math.lcm(*sizes), cfg.fault_tolerance.replica_groups
    cfg.data.global_batch = cfg.data.micro_batch * dp * groups
    distinct = sorted(set(sizes))
    why = "" if len(distinct) == 1 else f"; {dp} = lcm of the sizes {distinct}"
    factors, names = f"{cfg.data.micro_batch} x {dp}", "micro_batch x data-parallel size"
    if groups > 1:  # every group derives the same number from its own world
        factors, names = f"{factors} x {groups}", f"{names} per group x replica groups"
    return (
        f"data.global_batch unset: {factors} = {cfg.data.global_batch} ({names}{why}); set "
        "--data.global_batch=N to choose it"
    )


def check_pipeline(p: ParallelConfig, dims: Mapping[str, int], shown: str) -> None:
    """What pipeline parallel cannot compose with, and its micro-batch chunks. (TP, DDP and
    FSDP2 on the other dims compose: each stage module is parallelized on the sub-mesh.)"""
    # ZeRO-1 composes: its optimizer steps plain aliases of the replicated stage parameters
    # (Pipeline.local_parameters); loss parallel too: the last stage's schedule step runs in
    # loss_parallel() (parallel/pp/pipeline.py).
    if p.pp_microbatches < p.pp:
        raise ConfigError(
            f"parallel.pp_microbatches = {p.pp_microbatches} is fewer than the pp = {p.pp} "
            f"stages (mesh {shown}): the pipeline would idle; set pp_microbatches >= {p.pp}"
        )
    check_pipeline_schedule(p, shown)


# Schedules with several stages per rank (parallel/pp/placement.py places them).
PP_LOOPED = ("interleaved", "zb1p")  # pp_virtual_stages per rank, round-robin
PP_V_SHAPED = ("zbv", "dualpipev")  # 2 per rank: rank r holds stages r and 2 pp - 1 - r


def check_pipeline_schedule(p: ParallelConfig, shown: str) -> None:
    """What torch's multi-stage schedules need of pp_microbatches and the stages per rank,
    refused here rather than inside torch (torch.distributed.pipelining.schedules, 2.13)."""
    m, pp, name = p.pp_microbatches, p.pp, f"parallel.pp_schedule = {p.pp_schedule}"
    if p.pp_schedule in PP_V_SHAPED and p.pp_virtual_stages != 2:
        raise ConfigError(
            f"{name} holds exactly 2 stages per rank (a V: rank r holds stages r and "
            f"2 pp - 1 - r), but parallel.pp_virtual_stages = {p.pp_virtual_stages}; set "
            "pp_virtual_stages=2, or pp_schedule=interleaved or zb1p for another count"
        )
    rounds = max(1, m // pp)  # the looped schedules run the chunks in rounds of pp
    if p.pp_schedule in PP_LOOPED and m % rounds:
        fits = [k for k in range(pp, 4 * pp + 1) if k % max(1, k // pp) == 0]
        raise ConfigError(
            f"{name} with parallel.pp = {pp} runs the chunks in max(1, pp_microbatches // pp)"
            f" = {rounds} rounds, but parallel.pp_microbatches = {m} is not a multiple of "
            f"{rounds} (mesh {shown}); choose pp_microbatches in {fits}"
        )
    if p.pp_schedule == "dualpipev" and m < 2 * pp:
        raise ConfigError(
            f"{name} needs at least one chunk per stage (2 pp = {2 * pp} stages), but "
            f"parallel.pp_microbatches = {m} (mesh {shown}); set pp_microbatches >= {2 * pp}"
        )


def validate_for_world(cfg: Config, world_size: int) -> dict[str, int]:
    """Every check of ``cfg`` (:func:`validate`, then those that need the world size); run by
    the launcher before spawning workers and by ``init()``. ``world_size`` is one replica
    group's under ``fault_tolerance.replica_groups``: the layout is each group's, and the
    global batch is shared by every group's data-parallel ranks. An unset global batch (0) is
    checked as micro_batch x data-parallel size; :func:`resolve_global_batch` fills it in."""
    validate(cfg)
    check_diloco_groups(cfg.fault_tolerance)
    ckpt = cfg.checkpoint
    check_diloco_checkpoints(cfg.fault_tolerance, ckpt.interval, ckpt.local_interval)
    dims = resolve_mesh_dims(cfg.parallel, world_size)
    check_layout(cfg.parallel, dims)
    dp = dims["dp_replicate"] * dims["dp_shard"]
    grad_accumulation(cfg.data, dp, cfg.fault_tolerance.replica_groups)
    if cfg.parallel.pp > 1 and cfg.data.micro_batch % cfg.parallel.pp_microbatches:
        raise ConfigError(
            f"data.micro_batch = {cfg.data.micro_batch} does not split into parallel."
            f"pp_microbatches = {cfg.parallel.pp_microbatches} equal chunks (unequal chunks would "
            "weight samples unequally); choose a micro_batch that is a multiple of it"
        )
    return dims


def check_expert_parallel(p: ParallelConfig, dp: int, shown: str) -> None:
    """Expert parallel borrows ``ep`` of the data-parallel ranks: it must divide them, and it
    does not run under ZeRO-1 or a pipeline (checks that need the model run in parallelize)."""
    if dp % p.ep:
        allowed = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ConfigError(
            f"parallel.ep = {p.ep} does not divide the data-parallel size dp_replicate x "
            f"dp_shard = {dp} (mesh {shown}): the experts are split over groups of ep "
            f"data-parallel ranks; choose ep in {allowed}"
        )
    if p.zero == 1:
        raise ConfigError(
            f"parallel.ep = {p.ep} with parallel.zero = 1: ZeroRedundancyOptimizer broadcasts "
            "each parameter from one data-parallel rank to all, but the ranks of an ep group "
            "hold different experts; set parallel.zero=0 (DDP) or 2/3 (FSDP2)"
        )
    if p.pp > 1:
        raise ConfigError(
            f"parallel.ep = {p.ep} with parallel.pp = {p.pp} is not supported: expert "
            "parallel composes with DDP, FSDP2 and tensor parallel (docs/parallel.md, "
            "'Expert parallel'); set parallel.pp=1 or parallel.ep=1"
        )
    if p.cp > 1:
        raise ConfigError(
            f"parallel.ep = {p.ep} with parallel.cp = {p.cp} is not supported: expert groups "
            "are consecutive data-parallel ranks, and the cp ranks of one data-parallel rank "
            "share its batch; set parallel.cp=1 or parallel.ep=1"
        )


def check_layout(p: ParallelConfig, dims: Mapping[str, int]) -> None:
    """Combinations of degrees and ZeRO stage that no PyTorch tool runs; each error names the
    dims. (Checks that need the model, such as tp dividing the heads, run in parallelize.)"""
    shown = show_dims(dims)
    dp = dims["dp_replicate"] * dims["dp_shard"]
    if p.ep > 1:
        check_expert_parallel(p, dp, shown)
    # FSDP2 under cp shards over the flattened (dp_shard, cp) dims: cp ranks hold the same
    # parameters, so they can share their shards (docs/parallel.md, Context parallel).
    if p.zero > 0 and dims["dp_shard"] * dims.get("cp", 1) == 1:
        raise ConfigError(
            f"parallel.zero = {p.zero} shards over the dp_shard dim, but the mesh {shown} has "
            "dp_shard=1: nothing to shard over; set parallel.zero=0, or parallel.dp_shard > 1 "
            "(e.g. dp_shard=-1 with fewer dp_replicate/tp/pp)"
        )
    if p.cp > 1:
        check_context_parallel(p, shown)
    # DDP and ZeroRedundancyOptimizer do not take tensor-parallel DTensor parameters: with tp,
    # data parallelism is FSDP2 (zero = 0 runs as ZeRO-3 with a warning, in parallelize).
    if p.tp > 1 and dp > 1 and (p.zero == 1 or dims["dp_shard"] == 1):
        raise ConfigError(
            f"parallel.tp = {p.tp} with data parallelism dp_replicate x dp_shard = {dp} needs "
            f"FSDP2 over a dp_shard dim > 1, but parallel.zero = {p.zero} (mesh {shown}); set "
            "parallel.zero=2 or 3 and parallel.dp_shard > 1"
        )
    if p.pp > 1:
        check_pipeline(p, dims, shown)
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError(
            f"parallel.sequence_parallel = true splits along the sequence over the tp dim, but "
            f"the mesh {shown} has tp=1; set parallel.tp > 1 or parallel.sequence_parallel=false"
        )
    if p.loss_parallel and p.tp == 1:
        raise ConfigError(
            f"parallel.loss_parallel = true splits the logits over the tp dim, but the mesh "
            f"{shown} has tp=1; set parallel.tp > 1 or parallel.loss_parallel=false"
        )


def check_context_parallel(p: ParallelConfig, shown: str) -> None:
    """What context parallel (``parallel.cp > 1``) does not compose with yet. (Checks that need
    the model, its heads and its attention, run in parallelize; the sequence length in the
    step loop.)"""
    others = [
        (p.pp > 1, f"parallel.pp = {p.pp}", "parallel.pp=1"),
        (p.tp > 1, f"parallel.tp = {p.tp}", "parallel.tp=1"),
        (p.zero == 1, "parallel.zero = 1 (ZeroRedundancyOptimizer)", "parallel.zero=0, 2 or 3"),
    ]
    for refused, what, fix in others:
        if refused:
            raise ConfigError(
                f"parallel.cp = {p.cp} with {what} (mesh {shown}) is not supported: context "
                f"parallel composes with DDP (zero 0) and FSDP2 (zero 2/3) only; set {fix} or "
                "parallel.cp=1"
            )
