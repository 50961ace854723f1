"""``meshrun ckpt export --hf``: checkpoints of a transformers model trained under ZeRO-3 (with
activation checkpointing, tied embeddings) and under TP 2 become directories that
``AutoModelForCausalLM.from_pretrained`` loads with the trained model's logits (fp32).

A 2-rank launch per layout trains a tiny Llama (2 layers) 2 steps (AdamW, the checkpoint at the last
step), returns the distributed model's logits on a fixed
batch and its full weights; the parent exports each checkpoint in shards small enough to give
several files, loads them with ``from_pretrained`` and compares. ``--dtype bf16`` halves the
bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import Dataset

import byo_models
import meshrun
from _dist import run_distributed
from meshrun.checkpoint import on_disk
from meshrun.cli.main import main as cli_main

STEPS = 2
LAYOUTS: dict[str, dict[str, Any]] = {
    "zero3_ac_tied": {"zero": 3, "activation_checkpoint": 1},
    "tp2": {"tp": 2},
    "pp2_tied": {"pp": 2, "pp_microbatches": 2},
}
TIED = {"zero3_ac_tied": True, "tp2": False, "pp2_tied": True}
SHARD = "30KB"  # the 2-layer tiny Llama is ~110 kB in fp32: several shards


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 16, (64, byo_models.SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i]}


def probe() -> torch.Tensor:
    return torch.randint(
        0, byo_models.VOCAB, (2, byo_models.SEQ), generator=torch.Generator().manual_seed(1)
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def config_of(root: Path, name: str) -> meshrun.Config:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = str(root / name), "cpu", 120.0
    cfg.data.global_batch, cfg.data.micro_batch = 8, 4
    cfg.optim.steps, cfg.optim.lr = STEPS, 0.01
    cfg.metrics.progress = False
    cfg.checkpoint.dir, cfg.checkpoint.interval = str(root / name / "ckpt"), STEPS
    for key, value in LAYOUTS[name].items():
        setattr(cfg.parallel, key, value)
    return cfg


def train_pipeline(root: Path, name: str) -> dict[str, Any]:
    """PP 2: the model built on meta, each rank's stage allocated and loaded from a
    save_pretrained directory, trained, checkpointed; the last stage's logits and every
    stage's weights (both copies of the tied embedding) come back."""
    from transformers import AutoConfig, AutoModelForCausalLM

    run = meshrun.init(config_of(root, name), argv=[])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(root / "pretrained"), attn_implementation="eager"
        )
    pipe = run.pipeline(model, lm_loss)
    run.load_pretrained(pipe, root / "pretrained")
    opt = torch.optim.AdamW(pipe.parameters(), lr=run.scaled_lr())
    loader = run.dataloader(Tokens())
    run.resume(pipe, opt, loader)
    for batch in run.steps(loader):
        run.pipeline_step(pipe, batch["x"][:, :-1], batch["x"][:, 1:])
        run.optimizer_step(opt)
    for m in pipe.modules:
        m.eval()
    with torch.no_grad():
        x = probe()
        out = pipe.schedule.eval(*((x,) if pipe.is_first else ()), target=x)
    weights = {k: v.detach().clone() for m in pipe.modules for k, v in m.state_dict().items()}
    run.close()
    logits = out.detach().clone() if pipe.is_last else None
    return {"logits": logits, "weights": weights}


def train_one(root: Path, name: str) -> dict[str, Any]:
    if LAYOUTS[name].get("pp", 1) > 1:
        return train_pipeline(root, name)
    run = meshrun.init(config_of(root, name), argv=[])
    model = run.parallelize(
        byo_models.tiny_llama(num_hidden_layers=2, tie_word_embeddings=TIED[name])
    )
    opt = torch.optim.AdamW(model.parameters(), lr=run.scaled_lr())
    loader = run.dataloader(Tokens())
    run.resume(model, opt, loader)
    for batch in run.steps(loader):
        x = batch["x"]
        logits = byo_models.logits_of(model, x[:, :-1])
        run.backward(lm_loss(logits, x[:, 1:]))
        run.optimizer_step(opt)
    with torch.no_grad():
        logits = byo_models.logits_of(model, probe()).detach().clone()
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    run.close()
    return {"logits": logits, "weights": {k: v.clone() for k, v in full.items()}}


def train(rank: int, world_size: int, root: Path, name: str) -> dict[str, Any]:
    return train_one(root, name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Each layout in its own launch (a second meshrun.init in one process is not supported)."""
    root = tmp_path_factory.mktemp("export_hf")
    byo_models.tiny_llama(num_hidden_layers=2, tie_word_embeddings=True).save_pretrained(
        root / "pretrained", max_shard_size="40KB"
    )
    return root, {
        name: merged(run_distributed(train, 2, root, name, timeout=600.0)) for name in LAYOUTS
    }


def merged(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' results as one: the logits of a rank that has them (a pipeline's last
    stage), the weights of every rank (a pipeline's stages; whole on each rank otherwise)."""
    logits = next(r["logits"] for r in ranks if r["logits"] is not None)
    return {"logits": logits, "weights": {k: v for r in ranks for k, v in r["weights"].items()}}


def export(root: Path, name: str, out: Path, *extra: str) -> int:
    ckpt = on_disk.step_dir(root / name / "ckpt", STEPS)
    return cli_main(["ckpt", "export", str(ckpt), str(out), "--hf", *extra])


def weight_files(out: Path) -> list[Path]:
    return sorted(out.glob("model*.safetensors"))


@pytest.mark.timeout(1500)  # a hang guard: both launches run in the first test's setup
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_export_loads_with_from_pretrained_and_gives_the_trained_logits(
    trained: tuple[Path, dict[str, Any]], name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    root, got = trained
    out = root / f"{name}_hf"
    assert export(root, name, out, "--shard-size", SHARD) == 0
    print(capsys.readouterr().out)
    files = weight_files(out)
    assert len(files) >= 2, files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    written = {k: v for f in files for k, v in load_file(f).items()}
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in written.values())
    # The model's own names, no wrapper segment; a tied head written once, as save_pretrained.
    weights = got[name]["weights"]
    expect = set(weights) - ({"lm_head.weight"} if TIED[name] else set())
    assert set(written) == expect == set(index["weight_map"])
    assert all(torch.equal(written[k], weights[k]) for k in written)
    loaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight or not TIED[name]
    with torch.no_grad():
        logits = byo_models.logits_of(loaded, probe())
    diff = (logits - got[name]["logits"]).abs().max().item()
    print(f"{name}: {len(files)} shards, max |logits - trained| = {diff:.3g}")
    assert diff <= 1e-6


@pytest.mark.timeout(1500)  # a hang guard: both launches run in the first test's setup
def test_bf16_halves_the_bytes(trained: tuple[Path, dict[str, Any]]) -> None:
    from transformers import AutoModelForCausalLM

    root, got = trained
    sizes = {}
    for dtype in ("fp32", "bf16"):
        out = root / f"tp2_{dtype}"
        assert export(root, "tp2", out, "--dtype", dtype) == 0
        assert [f.name for f in weight_files(out)] == ["model.safetensors"]  # under 5GB: one
        sizes[dtype] = (out / "model.safetensors").stat().st_size
    print(f"fp32 {sizes['fp32']} bytes, bf16 {sizes['bf16']} bytes")
    header_slack = 8 << 10  # the JSON header is the same size in both: a few kB
    assert sizes["bf16"] <= sizes["fp32"] / 2 + header_slack
    assert sizes["bf16"] >= sizes["fp32"] / 2 - header_slack
    cfg = json.loads((root / "tp2_bf16" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(root / "tp2_bf16")
    assert loaded.dtype == torch.bfloat16
    with torch.no_grad():
        logits = byo_models.logits_of(loaded.float(), probe())
    assert (logits - got["tp2"]["logits"]).abs().max().item() < 0.1  # bf16 rounding only
