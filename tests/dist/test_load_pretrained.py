"""Pretrained weights into parallelized models: ``load_pretrained`` and ``checkpoint.init_from``.

A tiny Llama (tests/byo_models.py, from a LlamaConfig, nothing downloaded) is saved with
``save_pretrained(max_shard_size=...)`` into many safetensors files, once untied and once with
tied embeddings (``lm_head.weight`` then absent from the files). One 2-rank launch builds it on
the meta device under ZeRO-3 (through ``parallelize``, and through the user's own
``fully_shard`` on meta, where ``load_pretrained`` allocates), tensor parallel 2 and DDP, and on
CPU with other weights under pipeline parallel 2, loads the directory, and compares the logits
on a fixed batch with one process's ``from_pretrained`` (<= 1e-5). The bytes each rank read
show it read only its slices (ZeRO-3 and PP: the ranks' reads sum to the checkpoint); the tied
copies on two pipeline stages both hold the checkpoint's embedding.

A second launch measures the peak RSS of each rank while ``load_pretrained`` fills a 235 MB
model (fp32) under ZeRO-3 on 2 ranks; a third starts runs from ``checkpoint.init_from``: a
meshrun checkpoint saved under ZeRO-3 (loaded into TP 2) and the Hugging Face directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import byo_models
from _dist import run_distributed
from meshrun.config import ParallelConfig, check_layout
from meshrun.hf import load_pretrained
from meshrun.mesh import ParallelDims, build_mesh
from meshrun.parallel import parallelize, parallelize_pipeline

BATCH = 4
ATOL = 1e-5
CPU = torch.device("cpu")

# label -> (model, ParallelConfig fields, how it is built and parallelized)
Case = tuple[str, dict[str, Any], str]
CASES: dict[str, Case] = {
    "ZeRO-3": ("llama", {"zero": 3}, "parallelize"),
    "ZeRO-3 tied, own fully_shard on meta": ("llama_tied", {"zero": 3}, "fully_shard"),
    "TP 2": ("llama", {"tp": 2}, "parallelize"),
    "TP 2 tied": ("llama_tied", {"tp": 2}, "parallelize"),
    "DDP": ("llama", {"zero": 0}, "parallelize"),
    "PP 2": ("llama", {"pp": 2, "pp_microbatches": 2}, "pipeline"),
    "PP 2 tied": ("llama_tied", {"pp": 2, "pp_microbatches": 2}, "pipeline"),
}


def build(name: str, meta: bool, seed: int = 1) -> nn.Module:
    """The tiny Llama with other weights than the saved ones (seed 0): only a load fixes it."""
    tied = name == "llama_tied"
    if meta:
        with torch.device("meta"):
            return byo_models.tiny_llama(seed=seed, tie_word_embeddings=tied)
    return byo_models.tiny_llama(seed=seed, tie_word_embeddings=tied)


def fixed_ids() -> Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, byo_models.VOCAB, (BATCH, byo_models.SEQ), generator=g)


def save_dirs(root: Path) -> dict[str, Path]:
    out = {}
    for name in ("llama", "llama_tied"):
        d = root / name
        byo_models.tiny_llama(seed=0, tie_word_embeddings=name == "llama_tied").save_pretrained(
            d, max_shard_size="40KB"
        )
        assert len(list(d.glob("*.safetensors"))) >= 2, sorted(p.name for p in d.iterdir())
        out[name] = d
    return out


def reference_logits(d: Path) -> Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        return byo_models.logits_of(model.eval(), fixed_ids())


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _full(t: Tensor) -> Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def tied_state(model: nn.Module) -> str:
    net = getattr(model, "module", model)
    a, b = net.lm_head.weight, net.model.embed_tokens.weight
    if a is b:
        return "one tensor"
    return "equal" if torch.equal(_full(a), _full(b)) else "untied"


def pipe_logits(pipe: Any, ids: Tensor) -> Tensor | None:
    """The pipeline's logits on ``ids`` (forward only; on the last stage, else None)."""
    for m in pipe.modules:
        m.eval()
    with torch.no_grad():
        out = pipe.schedule.eval(*((ids,) if pipe.is_first else ()), target=ids)
    return _full(out) if pipe.is_last else None


def load_case(rank: int, case: Case, dirs: dict[str, Path]) -> dict[str, Any]:
    name, fields, how = case
    cfg = ParallelConfig(**fields)
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    check_layout(cfg, vars(dims))
    mesh, ids = build_mesh(dims, "cpu"), fixed_ids()
    if how == "pipeline":  # built on CPU: the stages are checked on a probe batch first
        pipe = parallelize_pipeline(build(name, meta=False), mesh, cfg, CPU, lm_loss)
        before = pipe_logits(pipe, ids)
        report = load_pretrained(pipe, dirs[name], device=CPU)
        logits = pipe_logits(pipe, ids)
        copies = {c.fqn: _full(c.param) for c in pipe.tied}
        return {"before": before, "logits": logits, "report": report, "copies": copies}
    model = build(name, meta=True)
    if how == "fully_shard":  # the user's own FSDP2, left on meta: load_pretrained allocates
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = parallelize(model, mesh, cfg, CPU)
    report = load_pretrained(model, dirs[name], device=CPU)
    with torch.no_grad():
        logits = _full(byo_models.logits_of(model.eval(), ids))
    return {"logits": logits, "report": report, "tied": tied_state(model)}


def load_cases(rank: int, world_size: int, dirs: dict[str, Path]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    out = {}
    for label, case in CASES.items():
        try:
            out[label] = load_case(rank, case, dirs)
        except Exception as e:  # name the layout: one launch runs them all
            raise RuntimeError(f"{label}: {type(e).__name__}: {e}") from e
    return out


def _embedding(d: Path) -> Tensor:
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in index  # tied: save_pretrained wrote one name
    with safe_open(str(d / index["model.embed_tokens.weight"]), framework="pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


@pytest.mark.timeout(400)
def test_load_pretrained_under_zero3_tp_ddp_pp_matches_from_pretrained(tmp_path: Path) -> None:
    dirs = save_dirs(tmp_path)
    refs = {name: reference_logits(d) for name, d in dirs.items()}
    results = run_distributed(load_cases, 2, dirs, timeout=370)
    for label, (name, _, how) in CASES.items():
        per_rank = [r[label] for r in results]
        logits = [r["logits"] for r in per_rank if r["logits"] is not None]
        assert logits, label
        diff = max(float((x - refs[name]).abs().max()) for x in logits)
        read = [r["report"].bytes_read for r in per_rank]
        total = per_rank[0]["report"].checkpoint_bytes
        print(f"{label}: max |logit - from_pretrained| = {diff:.2g}, bytes read {read} of {total}")
        assert diff <= ATOL, f"{label}: {diff}"
        if how == "pipeline":
            before = next(r["before"] for r in per_rank if r["before"] is not None)
            assert float((before - refs[name]).abs().max()) > 1e-2, label  # the load mattered
        else:
            assert {r["tied"] for r in per_rank} <= {"one tensor", "equal"} or name == "llama"
    # Each rank read only its slices: FSDP2 shards every tensor, pipeline stages split them.
    reads = {label: [r[label]["report"].bytes_read for r in results] for label in CASES}
    total = {label: results[0][label]["report"].checkpoint_bytes for label in CASES}
    for label in ("ZeRO-3", "ZeRO-3 tied, own fully_shard on meta", "PP 2"):
        assert sum(reads[label]) == total[label], (label, reads[label], total[label])
    assert reads["DDP"] == [total["DDP"]] * 2
    assert all(r < total["TP 2"] for r in reads["TP 2"])
    assert results[0]["ZeRO-3 tied, own fully_shard on meta"]["report"].allocated
    # PP tied: the lm_head stage read the embedding (the files have no lm_head.weight), and
    # both copies hold the checkpoint's values.
    embedding = _embedding(dirs["llama_tied"])
    assert sum(reads["PP 2 tied"]) == total["PP 2 tied"] + embedding.numel() * 4
    copies = [t for r in results for t in r["PP 2 tied"]["copies"].values()]
    assert len(copies) == 2 and all(torch.equal(c, embedding) for c in copies)
