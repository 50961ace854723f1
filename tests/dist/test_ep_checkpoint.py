"""Expert-parallel runs through ``meshrun.init`` on Gloo: checkpoints, resume, metrics.

A run of 6 steps at ``ep = 2`` (2 ranks, FSDP2 ZeRO-3, AdamW; on 4 ranks the experts are also
FSDP2-sharded over their 2 replicas) saves at steps 3 and 6. Resumed
from step 3 at ``ep = 2`` it repeats steps 4-6 bitwise (losses and final parameters); resumed
at ``ep = 1`` (the experts whole on every rank) the losses stay within 1e-6 relative: the
experts are saved as one process names them (DTensor ``Shard(0)`` over ep with the global
shape, or a ModuleList expert under its global index). Qwen2-MoE has fused expert tensors, the
model of our own a ModuleList of experts; the Qwen2-MoE checkpoint exported with ``--hf`` loads
with ``from_pretrained`` into the run's weights. Each step's metrics carry the tokens per expert (the
whole batch's: 8 sequences x 16 positions x top-2 per layer) and their imbalance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import meshrun
import moe_models
from _dist import run_distributed
from meshrun.checkpoint import on_disk
from meshrun.parallel.structure import ModelSpec

GLOBAL_BATCH, SAVE_AT, STEPS = 8, 3, 6


def make_config(run_dir: Path, ckpt: Path, resume: str, ep: int, world: int = 2) -> meshrun.Config:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = str(run_dir), "cpu", 60.0
    cfg.data.global_batch, cfg.data.micro_batch = GLOBAL_BATCH, GLOBAL_BATCH // world
    cfg.optim.steps, cfg.optim.lr, cfg.optim.warmup_steps = STEPS, 0.01, 0
    cfg.metrics.progress = False
    cfg.checkpoint.dir, cfg.checkpoint.resume = str(ckpt), resume
    cfg.checkpoint.interval = SAVE_AT
    cfg.parallel.zero, cfg.parallel.ep = 3, ep
    return cfg


def train(rank: int, world_size: int, cfg: meshrun.Config, kind: str) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    run = meshrun.init(cfg, argv=[])
    spec = ModelSpec(experts=moe_models.OWN_EXPERTS) if kind == "own" else None
    model = run.parallelize(moe_models.BUILDERS[kind](), spec=spec)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    loader = run.dataloader(moe_models.Tokens())
    start = run.resume(model, opt, loader)
    losses: dict[int, float] = {}
    for batch in run.steps(loader):
        loss = moe_models.loss_of(model, batch)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses[run.step + 1] = float(total) / world_size
        run.backward(loss)
        run.optimizer_step(opt)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    from meshrun.parallel.ep import full_state_dict

    params = full_state_dict(model) if cfg.parallel.ep > 1 else full
    run.close()
    return {"start": start, "losses": losses, "params": params if rank == 0 else None}


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" in r and "event" not in r]


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("kind", "world"),
    [
        # heavy (CI's time): [own-2] stays, the same resume bitwise and at ep = 1
        pytest.param("qwen2_moe", 2, marks=pytest.mark.heavy),
        ("own", 2),
        # heavy: the 2-rank params show resume bitwise and at ep = 1; test_ep.py's
        # test_ep_four_ranks shows the experts FSDP2-sharded over their replicas
        pytest.param("qwen2_moe", 4, marks=pytest.mark.heavy),
    ],
)
def test_ep_resume_bitwise_and_at_another_ep(tmp_path: Path, kind: str, world: int) -> None:
    ckpt = tmp_path / "ckpt"
    cfg = make_config(tmp_path / "ref", ckpt, "never", 2, world)
    ref = run_distributed(train, world, cfg, kind, timeout=200)
    assert [c.step for c in on_disk.list_checkpoints(ckpt)] == [SAVE_AT, STEPS]
    rows = metrics_rows(tmp_path / "ref")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        per_layer = json.loads(r["moe_tokens_per_expert"])
        assert len(per_layer) == moe_models.LAYERS
        assert all(len(c) == moe_models.EXPERTS for c in per_layer.values())
        assert all(sum(c) == GLOBAL_BATCH * moe_models.SEQ * 2 for c in per_layer.values())
        assert r["moe_imbalance"] >= 1.0
    if kind == "qwen2_moe" and world == 2:
        check_hf_export(ckpt, tmp_path / "hf", ref[0]["params"])
    at = str(on_disk.step_dir(ckpt, SAVE_AT))
    for ep in (2, 1):
        cfg = make_config(tmp_path / f"ep{ep}", tmp_path / f"ckpt{ep}", at, ep, world)
        got = run_distributed(train, world, cfg, kind, timeout=200)
        assert {g["start"] for g in got} == {SAVE_AT}
        later = {s: ref[0]["losses"][s] for s in range(SAVE_AT + 1, STEPS + 1)}
        diffs = [abs(got[0]["losses"][s] - v) / abs(v) for s, v in later.items()]
        p_ref, p_got = ref[0]["params"], got[0]["params"]
        assert p_got.keys() == p_ref.keys()
        pdiff = max(float((p_got[k] - p_ref[k]).abs().max()) for k in p_ref)
        print(
            f"{kind} on {world} ranks: resumed ep=2 -> ep={ep}: max rel loss diff "
            f"{max(diffs):.2e}, param {pdiff:.2e}"
        )
        if ep == 2:
            assert got[0]["losses"] == later  # bitwise
            assert all(torch.equal(p_got[k], p_ref[k]) for k in p_ref)
        else:
            assert max(diffs) <= 1e-6


def check_hf_export(ckpt: Path, out: Path, params: dict[str, torch.Tensor]) -> None:
    """``meshrun ckpt export --hf`` of the ep=2 run's last checkpoint loads with
    ``from_pretrained`` into the run's final weights, experts whole."""
    from transformers import Qwen2MoeForCausalLM

    from meshrun.checkpoint.export import export_hf

    export_hf(on_disk.step_dir(ckpt, STEPS), out)
    loaded = Qwen2MoeForCausalLM.from_pretrained(out).state_dict()
    assert loaded.keys() == params.keys()
    assert all(torch.equal(loaded[k], params[k]) for k in params)
