"""The model-structure layer: what find_structure reads from models meshrun did not write, the
start-up line for each, the user's spec first, and the tensor-parallel refusals (no processes:
the checks run before anything is split)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import byo_models
from meshrun.config import ConfigError
from meshrun.demo.model import GPT, demo_config
from meshrun.parallel.structure import ModelSpec, find_structure
from meshrun.parallel.tp import build_tp_plan, resolve_tp_plan, translate_plan

LINES = {
    "llama": "blocks: model.layers (4 x LlamaDecoderLayer, from _no_split_modules) | TP plan: "
    "_tp_plan (9 rules, 30 modules) | heads: 4 (kv 2) from config.num_attention_heads | "
    "tied: none",
    "qwen2": "blocks: model.layers (4 x Qwen2DecoderLayer, from _no_split_modules) | TP plan: "
    "_tp_plan (9 rules, 30 modules) | heads: 4 (kv 2) from config.num_attention_heads | "
    "tied: none",
    "gpt2": "blocks: transformer.h (4 x GPT2Block, from _no_split_modules) | TP plan: none | "
    "heads: 4 from config.n_head | tied: transformer.wte.weight = lm_head.weight",
    "nanogpt": "blocks: transformer.h (4 x Block, from convention: list of identical blocks) | "
    "TP plan: convention: linear-layer names (12 rules, 12 modules) | heads: 4 from "
    "config.n_head | tied: transformer.wte.weight = lm_head.weight",
    "demo": "blocks: blocks (2 x Block, from convention: list of identical blocks) | TP plan: "
    "convention: linear-layer names (12 rules, 12 modules) | heads: 2 from blocks.0.attn.n_head"
    " | tied: none",
}


def build(name: str) -> nn.Module:
    return {
        "llama": byo_models.tiny_llama,
        "qwen2": byo_models.tiny_qwen2,
        "gpt2": byo_models.tiny_gpt2,
        "nanogpt": byo_models.NanoGPT,
        "demo": lambda: GPT(demo_config("tiny")),
    }[name]()


@pytest.mark.parametrize("name", sorted(LINES))
def test_the_start_up_line_of_each_model(name: str) -> None:
    assert find_structure(build(name)).describe() == LINES[name]


def test_blocks_before_and_after_in_forward_order() -> None:
    s = find_structure(byo_models.NanoGPT())
    assert (s.family, s.blocks_fqn, s.n_blocks) == ("nanogpt", "transformer.h", 4)
    assert s.before == ("transformer.wte", "transformer.wpe", "transformer.drop")
    assert s.after == ("transformer.ln_f", "lm_head")
    assert s.block_names() == [f"transformer.h.{i}" for i in range(4)]
    assert s.is_block("transformer.h.2") and not s.is_block("transformer.h.2.attn")
    llama = find_structure(byo_models.tiny_llama())
    assert (llama.family, llama.before) == ("hf", ("model.embed_tokens",))
    assert llama.after[0] == "model.norm" and llama.after[-1] == "lm_head"
    assert llama.pp_plan is not None and "model.layers" in llama.pp_plan


def test_the_users_spec_comes_first_and_is_checked() -> None:
    model = byo_models.NanoGPT()
    s = find_structure(model, ModelSpec(blocks="transformer.h", num_heads=2, tp_plan={}))
    assert (s.family, s.sources["blocks"], s.num_heads, s.tp_plan_source) == (
        "user",
        "ModelSpec.blocks",
        2,
        "ModelSpec.tp_plan",
    )
    with pytest.raises(ConfigError, match=r"ModelSpec\(blocks='transformer\.x'\).*transformer\.h"):
        find_structure(model, ModelSpec(blocks="transformer.x"))
    with pytest.raises(ConfigError, match="not one tensor"):
        find_structure(model, ModelSpec(tied=(("transformer.wpe.weight", "lm_head.weight"),)))


def test_a_sequential_cnn_has_no_blocks_and_pp_says_what_to_pass() -> None:
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten())
    s = find_structure(cnn)
    assert (s.blocks_fqn, s.family) == (None, "generic")
    assert s.describe().startswith("blocks: none found")
    with pytest.raises(ConfigError, match=r"spec=ModelSpec\(blocks="):
        s.require_blocks("pipeline parallel")


def test_hf_plan_strings_become_dtensor_styles_and_unknown_ones_are_refused() -> None:
    styles = translate_plan({"a": "colwise", "b": "rowwise", "c": "replicate"})
    assert isinstance(styles["a"], ColwiseParallel) and isinstance(styles["b"], RowwiseParallel)
    assert "c" not in styles  # replicated: left whole
    with pytest.raises(ConfigError, match="'packed_colwise' is not a style"):
        translate_plan({"x": "packed_colwise"})
    model = byo_models.tiny_llama()
    plan = resolve_tp_plan(model, find_structure(model))
    assert len(plan) == 30 and isinstance(plan["model.embed_tokens"], RowwiseParallel)


def test_tp_refusals_name_the_reason_before_anything_is_split() -> None:
    kv1 = byo_models.tiny_llama(num_key_value_heads=1)
    with pytest.raises(ConfigError, match=r"config\.num_key_value_heads = 1: each tensor-par"):
        build_tp_plan(kv1, find_structure(kv1), 2)
    nano = byo_models.NanoGPT()
    with pytest.raises(ConfigError, match="c_attn computes q, k and v in one projection"):
        build_tp_plan(nano, find_structure(nano), 2)
    gpt2 = byo_models.tiny_gpt2()
    with pytest.raises(ConfigError, match="Conv1D"):
        build_tp_plan(gpt2, find_structure(gpt2), 2)
    conv1d = {"transformer.h.*.mlp.c_fc": "colwise"}
    with pytest.raises(ConfigError, match=r"cannot split transformer\.h\.0\.mlp\.c_fc: a trans"):
        build_tp_plan(gpt2, find_structure(gpt2, ModelSpec(tp_plan=conv1d)), 2)
    tied = byo_models.tiny_llama(tie_word_embeddings=True)
    one_side = {"lm_head": "colwise"}
    with pytest.raises(ConfigError, match=r"one tensor \(tied\)"):
        build_tp_plan(tied, find_structure(tied, ModelSpec(tp_plan=one_side)), 2)
    assert torch.equal(tied.lm_head.weight, tied.model.embed_tokens.weight)  # nothing changed


def test_fsdp_without_blocks_is_said_not_silent(caplog: pytest.LogCaptureFixture) -> None:
    from meshrun.config import ParallelConfig
    from meshrun.parallel import units_of
    from meshrun.runtime.mesh import ParallelDims

    cnn = find_structure(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten()))
    dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, tp=1)
    with caplog.at_level("WARNING", logger="meshrun"):
        wrap = units_of(cnn, ParallelConfig(zero=3), 3, dims)
    assert "no repeated blocks found in Sequential" in caplog.text
    assert "whole model as one unit" in caplog.text and not wrap("0", None)
    caplog.clear()
    llama = find_structure(byo_models.tiny_llama())
    with caplog.at_level("WARNING", logger="meshrun"):
        wrap = units_of(llama, ParallelConfig(zero=3), 3, dims)
    assert caplog.text == "" and wrap("model.layers.3", None)
