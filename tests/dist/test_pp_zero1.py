"""Pipeline parallel composed with ZeRO-1, loss parallel and fp16, on 4 Gloo ranks (pp 2 x dp 2).

One 4-rank spawn (raw process group, the functions ``run.pipeline`` uses):

- PP 2 x ZeRO-1 2 (1F1B): the stages are replicated over dp by FSDP2's ``replicate`` and a
  ZeroRedundancyOptimizer over the dp group steps plain aliases of their parameters; 5 steps
  give the single-process fp32 reference's per-step losses, clipped norms and parameters, and
  each rank's optimizer state is a part of its stage's (sharded, not whole);
- PP 2 x TP 2 + loss parallel (1F1B): the last stage computes the cross-entropy on the
  vocab-sharded logits inside ``loss_parallel()``; the same reference numbers;
- fp16 under PP 2 x ZeRO-1 2 and PP 2 x DP 2: an inf put into one gradient of rank 0 only
  (stage 0, dp rank 0) makes all four ranks skip the step (parameters unchanged) and halve the
  scale together; the next step trains.

Two more 4-rank spawns run the user's loop under ``meshrun.init`` with ``run.optimizer`` (ZeRO-1)
and ``run.pipeline``: 4 steps straight with a checkpoint at step 2, then a resume from it to step
4 (accumulation 2): the continued losses and the final parameters equal the straight run's,
bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_layouts import build_data, build_model, check_numerics, reference
from test_layouts_pp import N_LAYER, Windows, lm_loss, train_pp
from torch import Tensor
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from _dist import run_distributed
from meshrun.config import ParallelConfig
from meshrun.runtime.mesh import ParallelDims, build_mesh
from meshrun.parallel import (
    build_grad_scaler,
    build_optimizer,
    parallelize_pipeline,
    pipeline_step,
)

LAYOUTS: dict[str, dict[str, Any]] = {
    "PP 2 x ZeRO-1 2 1F1B": {"pp": 2, "zero": 1, "pp_schedule": "1f1b"},
    "PP 2 x TP 2 + loss parallel": {"pp": 2, "tp": 2, "loss_parallel": True},
}
INF_LAYOUTS: dict[str, dict[str, Any]] = {
    "PP 2 x ZeRO-1 2 fp16": {"pp": 2, "zero": 1, "param_dtype": "float16"},
    "PP 2 x DP 2 fp16": {"pp": 2, "zero": 0, "param_dtype": "float16"},
}


def inf_skip(rank: int, layout: dict[str, Any], data: torch.Tensor) -> dict[str, Any]:
    """Step 1 with an inf in one gradient of rank 0 (stage 0, dp rank 0) only, then step 2."""
    cfg = ParallelConfig(**layout)
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    mesh, cpu = build_mesh(dims, "cpu"), torch.device("cpu")
    scaler = build_grad_scaler(cfg, cpu)
    assert scaler is not None
    pipe = parallelize_pipeline(
        build_model(n_layer=N_LAYER), mesh, cfg, cpu, lm_loss, scaler=scaler
    )
    opt = build_optimizer(pipe, torch.optim.SGD, mesh, cfg, lr=0.3, momentum=0.9)
    params = [p for g in opt.param_groups for p in g["params"]]
    per_rank = data.shape[1] // dims.dp
    mine = data[:, dims.dp_rank(rank) * per_rank : (dims.dp_rank(rank) + 1) * per_rank]
    out: dict[str, Any] = {"scales": [scaler.get_scale()], "changed": [], "finite": []}
    for step in range(2):
        pipeline_step(pipe, mine[step, :, :-1], mine[step, :, 1:])
        if step == 0 and rank == 0:
            grad = params[0].grad
            assert grad is not None
            grad.view(-1)[0] = float("inf")  # after the dp all-reduce: this rank's copy only
        grads = [p.grad for p in params if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        out["finite"].append(all(bool(g.isfinite().all()) for g in local))  # this rank's own
        before = [p.detach().clone() for p in pipe.parameters()]
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        after = pipe.parameters()
        out["changed"].append(
            any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        )
        out["scales"].append(scaler.get_scale())
    out["stage"], out["optim_type"] = mesh["pp"].get_local_rank(), type(opt).__name__
    return out


SEEN: list[str] = []  # what the loss saw, on this rank


def recording_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """lm_loss, noting whether the logits are vocab-sharded and loss_parallel() is active."""
    handlers = DTensor._op_dispatcher._custom_op_handlers  # what loss_parallel() installs
    placements = logits.placements if isinstance(logits, DTensor) else "plain"
    SEEN.append(f"{placements} {torch.ops.aten._log_softmax.default in handlers}")
    return lm_loss(logits, targets)


def layouts_world(rank: int, world_size: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    data = build_data()
    out: dict[str, Any] = {
        name: train_pp(rank, layout, data, loss_fn=recording_loss)
        for name, layout in LAYOUTS.items()
    }
    out["seen"] = sorted(set(SEEN))
    out |= {name: inf_skip(rank, layout, data) for name, layout in INF_LAYOUTS.items()}
    return out


@pytest.mark.timeout(300)
def test_pp_with_zero1_loss_parallel_and_fp16_skip() -> None:
    ref = reference(N_LAYER)
    results = run_distributed(layouts_world, 4, timeout=270)
    for name in LAYOUTS:
        check_numerics(name, results[0][name], ref)
    # the loss ran on the last stage (ranks 2, 3) only; with loss parallel on logits sharded
    # over the vocabulary, inside loss_parallel(); without it on plain logits
    assert [r["seen"] for r in results[:2]] == [[], []], results[0]["seen"]
    for r in results[2:]:
        assert r["seen"] == ["(Shard(dim=2),) True", "plain False"], r["seen"]
    zero1 = [r["PP 2 x ZeRO-1 2 1F1B"] for r in results]
    assert {r["optim_type"] for r in zero1} == {"ZeroRedundancyOptimizer"}
    for rank, r in enumerate(zero1):  # each rank holds a part of its stage's momentum only
        assert 0 < r["optim_bytes"] < r["stage_bytes"], (rank, r["optim_bytes"], r["stage_bytes"])
    print(
        "PP 2 x ZeRO-1 2 optimizer bytes per rank:",
        [r["optim_bytes"] for r in zero1],
        "of its stage's",
        [r["stage_bytes"] for r in zero1],
    )
    for name in INF_LAYOUTS:
        got = [r[name] for r in results]
        assert sorted(r["stage"] for r in got) == [0, 0, 1, 1], name
        for rank, r in enumerate(got):
            # step 1 skipped on every rank (both stages, both dp ranks), scale halved together;
            # step 2 trains with the lower scale
            assert r["finite"] == [rank != 0, True], (name, rank, r)  # only rank 0 saw the inf
            assert r["changed"] == [False, True], (name, rank, r)
            assert r["scales"] == [65536.0, 32768.0, 32768.0], (name, rank, r)
        print(
            f"{name}: inf on rank 0 (stage 0) only -> all 4 ranks skipped, scales {got[0]['scales']}"
        )


# --- PP x ZeRO-1 checkpoints through meshrun.init -------------------------------------------

STEPS, SAVE_AT = 4, 2


def user_run(rank: int, world: int, root: str, resume: str, interval: int) -> dict[str, Any]:
    import meshrun

    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = (
        f"{root}/run-{resume != 'never'}",
        "cpu",
        60.0,
    )
    cfg.metrics.progress = False
    cfg.data.global_batch, cfg.data.micro_batch, cfg.optim.steps = 16, 4, STEPS  # accumulation 2
    cfg.parallel.pp, cfg.parallel.zero, cfg.parallel.pp_microbatches = 2, 1, 2
    cfg.checkpoint.dir, cfg.checkpoint.resume = f"{root}/ckpt", resume
    cfg.checkpoint.interval, cfg.checkpoint.keep_last = interval, 10
    run = meshrun.init(cfg, argv=[])
    pipe = run.pipeline(build_model(n_layer=N_LAYER), lm_loss)
    opt = run.optimizer(pipe, torch.optim.AdamW, lr=3e-3)
    assert isinstance(opt, ZeroRedundancyOptimizer)
    loader = run.dataloader(Windows())
    start = run.resume(pipe, opt, loader)
    losses = {}
    for batch in run.steps(loader):
        loss = run.pipeline_step(pipe, batch["input"], batch["target"])
        if run.optimizer_step(opt):
            losses[run.step] = float(loss)
    params = {
        k: v.detach().clone()
        for k, v in zip(
            [n for m in pipe.modules for n, _ in m.named_parameters()],
            pipe.parameters(),
            strict=True,
        )
    }
    params = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in params.items()}
    run.close()
    return {"start": start, "losses": losses, "params": params}


# heavy (CI's time): a pipeline checkpoint resuming bitwise stays in CI in test_checkpoint_pp.py
@pytest.mark.heavy
@pytest.mark.timeout(450)
def test_pp_zero1_checkpoint_resumes_the_same_losses(tmp_path: Path) -> None:
    straight = run_distributed(user_run, 4, str(tmp_path), "never", SAVE_AT, timeout=200)
    path = tmp_path / "ckpt" / "step_00000002"
    keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    model_keys = {f"model.{k}" for k in build_model(n_layer=N_LAYER).state_dict()}
    assert model_keys <= keys, sorted(model_keys - keys)[:5]  # the unsplit model's names
    for b in range(N_LAYER):  # AdamW state of every stage, each entry from its ZeRO owner
        assert f"optim.state.blocks.{b}.attn.q.weight.exp_avg" in keys, sorted(keys)[:20]
    resumed = run_distributed(user_run, 4, str(tmp_path), str(path), 0, timeout=200)
    for rank, (a, b) in enumerate(zip(straight, resumed, strict=True)):
        assert b["start"] == SAVE_AT
        assert list(b["losses"]) == [3, 4], b["losses"]
        assert b["losses"] == {k: a["losses"][k] for k in (3, 4)}, (rank, a, b)
        for k, v in a["params"].items():
            assert torch.equal(v, b["params"][k]), f"rank {rank}: {k} differs after resume"
    print(
        "PP 2 x ZeRO-1 2 resume: straight", straight[0]["losses"], "resumed", resumed[0]["losses"]
    )
