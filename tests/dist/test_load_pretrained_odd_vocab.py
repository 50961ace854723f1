"""Sharded Hugging Face directories of models other than the Llama of test_load_pretrained.py,
loaded with ``load_pretrained`` on 2 Gloo ranks: a Qwen2 with an odd vocabulary (257) and tied
embeddings, and a GPT-2 (transformers' Conv1D projections, tied head) with the same vocabulary,
each saved by ``save_pretrained(max_shard_size=...)`` into several files. ZeRO-3 on the meta
device, ZeRO-3 built on CPU after a forward (FSDP2's root then holds its parameters gathered),
and TP 2 for the Qwen2 (its head split unevenly): the logits on a fixed batch equal one
process's ``from_pretrained`` within 1e-5, and the weights before the load were others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import byo_models
from _dist import run_distributed
from meshrun.config import ParallelConfig, check_layout
from meshrun.hf import load_pretrained
from meshrun.runtime.mesh import ParallelDims, build_mesh
from meshrun.parallel import parallelize

VOCAB = 257
ATOL = 1e-5
CPU = torch.device("cpu")
CASES: dict[str, tuple[str, dict[str, Any], bool]] = {  # label -> (model, layout, on meta)
    "qwen2 ZeRO-3 meta": ("qwen2", {"zero": 3}, True),
    "qwen2 ZeRO-3 cpu": ("qwen2", {"zero": 3}, False),
    "qwen2 TP 2 meta": ("qwen2", {"tp": 2}, True),
    "gpt2 ZeRO-3 meta": ("gpt2", {"zero": 3}, True),
}


def build(name: str, seed: int, meta: bool) -> nn.Module:
    make = byo_models.tiny_qwen2 if name == "qwen2" else byo_models.tiny_gpt2
    kw = {"vocab_size": VOCAB, "tie_word_embeddings": True}
    if meta:
        with torch.device("meta"):
            return make(seed=seed, **kw)
    return make(seed=seed, **kw)


def ids() -> Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (4, byo_models.SEQ), generator=g)


def _full(t: Tensor) -> Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def load_all(rank: int, world: int, dirs: dict[str, Path]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    out = {}
    for label, (name, fields, meta) in CASES.items():
        cfg = ParallelConfig(**fields)
        dims = ParallelDims.from_config(cfg, world)
        check_layout(cfg, vars(dims))
        model = parallelize(build(name, 1, meta), build_mesh(dims, "cpu"), cfg, CPU)
        before = None
        if not meta:
            with torch.no_grad():
                before = _full(byo_models.logits_of(model.eval(), ids()))
        report = load_pretrained(model, dirs[name], device=CPU)
        with torch.no_grad():
            logits = _full(byo_models.logits_of(model.eval(), ids()))
        out[label] = {"logits": logits, "before": before, "tensors": report.tensors}
    return out


@pytest.mark.timeout(400)
def test_sharded_odd_vocab_qwen2_and_gpt2_under_zero3_and_tp(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    dirs, refs = {}, {}
    for name in ("qwen2", "gpt2"):
        d = tmp_path / name
        build(name, 0, False).save_pretrained(d, max_shard_size="40KB")
        assert len(list(d.glob("*.safetensors"))) >= 3, sorted(p.name for p in d.iterdir())
        ref = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
        with torch.no_grad():
            refs[name] = byo_models.logits_of(ref.eval(), ids())
        dirs[name] = d
    results = run_distributed(load_all, 2, dirs, timeout=370)
    for label, (name, _, meta) in CASES.items():
        diff = max(float((r[label]["logits"] - refs[name]).abs().max()) for r in results)
        print(f"{label}: max |logit - from_pretrained| = {diff:.2g}")
        assert diff <= ATOL, (label, diff)
        if not meta:
            assert float((results[0][label]["before"] - refs[name]).abs().max()) > 1e-2
