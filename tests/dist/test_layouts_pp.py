"""Pipeline parallel trains a 4-block demo GPT exactly like one process with the global batch.

One 4-rank spawn runs pp=2 x dp_shard=2 (FSDP2 on each stage) with GPipe, 1F1B and interleaved
1F1B (2 stages per rank), pp=4 with 1F1B, pp=2 x DDP 2 (replicate per stage), pp=2 x tp=2 with
1F1B and pp=2 x tp=2 + SP interleaved, each on a fresh model and mesh; per-step losses,
clipped gradient norms (combined over the stages) and final parameters are compared with the
single-process reference of test_layouts.py on the same model shape. A 2-rank spawn runs the
user's loop under ``meshrun.init`` with ``run.pipeline`` and accumulation 2, then evaluates:
``run.evaluate`` on 13 held-out windows (micro-batches 4, 4, 4 and a partial 1) and
``run.pipeline_eval`` on 3 rows (not a multiple of the 2 chunks) and 9 rows (more than the
first eval batch), each against one process's mean loss over the same examples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_layouts import (
    CLIP,
    LR,
    STEPS,
    Layout,
    build_data,
    build_model,
    check_numerics,
    local_bytes,
    reference,
    state_bytes,
)
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_distributed
from meshrun.config import ParallelConfig, check_layout
from meshrun.parallel import (
    build_grad_scaler,
    build_optimizer,
    clip_grad_norm_,
    parallelize_pipeline,
    pipeline_step,
)
from meshrun.runtime.mesh import ParallelDims, build_mesh

N_LAYER = 4


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def train_pp(
    rank: int,
    layout: Layout,
    data: torch.Tensor,
    n_layer: int = N_LAYER,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = lm_loss,
) -> dict[str, Any]:
    """5 steps of ``layout`` the way run.pipeline_step / run.optimizer_step do them (scaler,
    clipping over the stages, the ZeRO-1 optimizer from build_optimizer)."""
    cfg = ParallelConfig(**layout)
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    check_layout(cfg, vars(dims))
    mesh, cpu = build_mesh(dims, "cpu"), torch.device("cpu")
    scaler = build_grad_scaler(cfg, cpu)
    model = build_model(n_layer=n_layer)
    pipe = parallelize_pipeline(model, mesh, cfg, cpu, loss_fn, scaler=scaler)
    opt = build_optimizer(pipe, torch.optim.SGD, mesh, cfg, lr=LR, momentum=0.9)
    params = pipe.parameters()
    per_rank = data.shape[1] // dims.dp
    dp_rank = dims.dp_rank(rank)
    losses, norms = [], []
    for step in range(STEPS):
        mine = data[step, dp_rank * per_rank : (dp_rank + 1) * per_rank]
        loss = pipeline_step(pipe, mine[:, :-1], mine[:, 1:])
        if scaler is not None:
            scaler.unscale_(opt)
        norms.append(float(clip_grad_norm_(params, CLIP, pp_group=pipe.group)))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        dist.all_reduce(loss, group=mesh.get_group("dp"))
        losses.append(float(loss) / dims.dp)
    mine_params = {}
    for m in pipe.modules:
        stage = m.module if isinstance(m, DDP) else m
        for k, v in stage.state_dict().items():
            mine_params[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine_params)
    merged = {k: v for d in everyone for k, v in d.items()}
    return {
        "losses": losses,
        "norms": norms,
        "params": merged if rank == 0 else None,
        "scale": None if scaler is None else scaler.get_scale(),
        "stage_types": sorted({type(m).__name__ for m in pipe.modules}),
        "optim_type": type(opt).__name__,
        "dtensor_params": sum(isinstance(p, DTensor) for p in params),
        "optim_bytes": state_bytes(pipe.modules[0], opt)["optim"],  # this rank's state
        "stage_bytes": local_bytes(
            [p for p in params]
        ),  # what an unsharded optimizer's state would take
    }


def train_pp_layouts(rank: int, world_size: int, layouts: dict[str, Layout]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    data = build_data()
    return {name: train_pp(rank, layout, data) for name, layout in layouts.items()}


PP_LAYOUTS: dict[str, Layout] = {
    "PP 2 x DP 2 GPipe": {"pp": 2, "zero": 3, "pp_schedule": "gpipe"},
    "PP 2 x DP 2 1F1B": {"pp": 2, "zero": 3, "pp_schedule": "1f1b"},
    "PP 2 x DP 2 interleaved": {"pp": 2, "zero": 3, "pp_schedule": "interleaved"},
    "PP 4 1F1B": {"pp": 4, "pp_schedule": "1f1b", "pp_microbatches": 4},
    # Each stage module parallelized on the non-pp sub-mesh (torchtitan's flow).
    "PP 2 x DDP 2 1F1B": {"pp": 2, "zero": 0, "pp_schedule": "1f1b"},
    "PP 2 x TP 2 1F1B": {"pp": 2, "tp": 2, "pp_schedule": "1f1b"},
    "PP 2 x TP 2 + SP interleaved": {
        "pp": 2,
        "tp": 2,
        "sequence_parallel": True,
        "pp_schedule": "interleaved",
    },
}


@pytest.mark.timeout(240)
def test_pipeline_layouts_match_one_process() -> None:
    ref = reference(N_LAYER)
    assert ref["losses"][-1] < ref["losses"][0], ref["losses"]
    results = run_distributed(train_pp_layouts, 4, PP_LAYOUTS, timeout=210)
    for name in PP_LAYOUTS:
        got = results[0][name]
        check_numerics(name, got, ref)
    got = results[0]
    assert got["PP 2 x DDP 2 1F1B"]["stage_types"] == ["ReplicateStageModule"]
    assert got["PP 2 x DP 2 GPipe"]["stage_types"] == ["FSDPStageModule"]
    for name in ("PP 2 x TP 2 1F1B", "PP 2 x TP 2 + SP interleaved"):
        assert got[name]["dtensor_params"] > 0, name  # the stage's linears really are split
        assert got[name]["stage_types"] == ["StageModule"], name


# --- the user's loop under meshrun.init: run.pipeline / run.pipeline_step ------------------


class Windows(torch.utils.data.Dataset[dict[str, Tensor]]):
    """64 token windows of bytes 0-15 (learnable within a few steps)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, 16, (64, 33), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"input": self.tokens[i, :-1], "target": self.tokens[i, 1:]}


class HeldOut(torch.utils.data.Dataset[tuple[Tensor, Tensor]]):
    """13 windows: with micro-batch 4 the last eval batch holds 1 (a partial batch)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(2)
        self.tokens = torch.randint(0, 16, (13, 33), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.tokens[i, :-1], self.tokens[i, 1:]


def make_config(run_dir: str) -> Any:
    import meshrun

    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = run_dir, "cpu", 60.0
    cfg.data.global_batch, cfg.data.micro_batch = 8, 4  # accumulation 2 on one dp rank
    cfg.optim.steps, cfg.optim.lr, cfg.optim.grad_clip = STEPS, LR, CLIP
    cfg.optim.warmup_steps, cfg.optim.decay = 0, "constant"
    cfg.metrics.progress = False
    cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.parallel.pp_microbatches = 2, "1f1b", 2
    return cfg


def user_loop(rank: int, world_size: int, cfg: Any) -> dict[str, Any]:
    import meshrun

    run = meshrun.init(cfg, argv=[])
    with pytest.raises(meshrun.ConfigError, match=r"run\.pipeline\(model, loss_fn\)"):
        run.parallelize(build_model(n_layer=N_LAYER))  # a pipeline is not called by the loop
    pipe = run.pipeline(build_model(n_layer=N_LAYER), lm_loss)
    opt = torch.optim.SGD(pipe.parameters(), lr=run.scaled_lr(), momentum=0.9)
    norms = []
    for batch in run.steps(run.dataloader(Windows())):
        run.pipeline_step(pipe, batch["input"], batch["target"])
        if run.optimizer_step(opt):
            norms.append(run.grad_norm)
    out: dict[str, Any] = {"norms": norms}
    out["evaluate"] = run.evaluate(pipe, run.dataloader(HeldOut(), mode="eval"))
    held = HeldOut().tokens
    for m in pipe.modules:
        m.eval()
    with torch.no_grad():
        for rows in (3, 9):
            out[f"eval {rows} rows"] = float(
                run.pipeline_eval(pipe, held[:rows, :-1], held[:rows, 1:])
            )
    run.close()
    return out


def loop_reference() -> tuple[list[float], list[float], dict[str, float]]:
    import meshrun

    ds = Windows()
    sampler = meshrun.ResumableSampler(
        len(ds), rank=0, world_size=1, global_batch=8, seed=meshrun.Config().job.seed
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler)
    model = build_model(n_layer=N_LAYER)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for _, batch in zip(range(STEPS), loader, strict=False):
        loss = lm_loss(model(batch["input"]), batch["target"])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    held = HeldOut().tokens
    with torch.no_grad():  # one forward over each set of examples: their mean loss
        evals = {
            f"eval {n} rows": float(lm_loss(model(held[:n, :-1]), held[:n, 1:])) for n in (3, 9)
        }
        evals["evaluate"] = float(lm_loss(model(held[:, :-1]), held[:, 1:]))
    return losses, norms, evals


@pytest.mark.timeout(150)
def test_run_pipeline_in_the_user_loop_with_accumulation(tmp_path: Any) -> None:
    import json

    ref_losses, ref_norms, ref_evals = loop_reference()
    results = run_distributed(user_loop, 2, make_config(str(tmp_path / "run")), timeout=120)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(r)["loss"] for r in rows if '"step"' in r and '"event"' not in r]
    assert logged == pytest.approx(ref_losses, rel=1e-4), (logged, ref_losses)
    for got in results:  # every stage clips by the norm over both stages
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-4)
        for key, ref in ref_evals.items():  # the same float on both ranks of the pipeline
            assert got[key] == pytest.approx(ref, rel=1e-5), (key, got[key], ref)
    print(f"run.pipeline: logged losses {[round(x, 5) for x in logged]}")
    print(f"held-out: {ref_evals} (one process) = {[results[0][k] for k in ref_evals]}")
