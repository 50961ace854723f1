"""``load_pretrained`` in one process: names matched between a checkpoint and a model (exact,
a consistent prefix, wrappers' components, ties), and the errors for what does not fit, raised
before any weight is read; the directory's checks; buffers recomputed after a meta build."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import byo_models
import meshrun.hf.load as hf_load
from meshrun.hf import PretrainedError, load_pretrained
from meshrun.hf.names import clean_name, match_names

IDS = torch.randint(0, byo_models.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


# --- names (pure) ---------------------------------------------------------------------------


def test_names_match_exactly_or_by_one_consistent_prefix() -> None:
    model = ["layers.0.w", "norm.w"]
    exact = match_names(model, {"layers.0.w", "norm.w"})
    assert (exact.rule, exact.missing, exact.unexpected) == ("exact", [], [])
    dropped = match_names(model, {"model.layers.0.w", "model.norm.w", "lm_head.w"})
    assert dropped.rule == "checkpoint prefix 'model.' dropped"
    assert dropped.sources == {"layers.0.w": "model.layers.0.w", "norm.w": "model.norm.w"}
    assert dropped.unexpected == ["lm_head.w"]
    added = match_names(["transformer.h.0.w", "lm_head.w"], {"h.0.w", "lm_head.w"})
    assert added.rule == "model prefix 'transformer.' added to the checkpoint's names"
    assert added.sources == {"transformer.h.0.w": "h.0.w", "lm_head.w": "lm_head.w"}
    two = match_names(["transformer.h.0.w"], {"model.h.0.w"})  # one rule, never two at once
    assert two.missing == ["transformer.h.0.w"] and two.unexpected == ["model.h.0.w"]
    # Exact wins ties; a tied name reads its partner's tensor; ignored patterns are not listed.
    tied = match_names(
        ["emb.w", "head.w"],
        {"emb.w", "rotary.inv_freq"},
        {"head.w": ["emb.w"], "emb.w": ["head.w"]},
        [r"rotary\.inv_freq"],
    )
    assert (tied.rule, tied.sources, tied.unexpected) == (
        "exact",
        {"emb.w": "emb.w", "head.w": "emb.w"},
        [],
    )
    assert clean_name("layers.0._checkpoint_wrapped_module._orig_mod.mlp.w") == "layers.0.mlp.w"


# --- load_pretrained on real models and directories -------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("llama")
    byo_models.tiny_llama(seed=0).save_pretrained(d, max_shard_size="40KB")
    return d


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return byo_models.logits_of(model.eval(), IDS)


def _meta_llama(**overrides: Any) -> nn.Module:
    with torch.device("meta"):
        return byo_models.tiny_llama(seed=1, **overrides)


def test_missing_and_unexpected_are_one_error_before_anything_is_read(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors import safe_open

    # A checkpoint with two tensors renamed and one dropped.
    state = {}
    for f in saved.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            state.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    state["model.layers.1.mlp.up.weight"] = state.pop("model.layers.1.mlp.up_proj.weight")
    state["extra.bias"] = state.pop("model.norm.weight")
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    reads: list[str] = []
    real = hf_load.copy_region
    monkeypatch.setattr(hf_load, "copy_region", lambda *a: reads.append(a[1]) or real(*a))
    model = _meta_llama()
    with pytest.raises(PretrainedError) as err:
        load_pretrained(model, tmp_path, device="cpu")
    text = str(err.value)
    assert (
        "3 missing (model tensors the checkpoint lacks): model.layers.1.mlp.up_proj.weight" in text
    )
    assert "model.norm.weight" in text and "lm_head.weight" in text
    assert (
        "2 unexpected (checkpoint tensors the model lacks): extra.bias, model.layers.1.mlp.up.weight"
        in text
    )
    assert "Nothing was read" in text and "strict=False" in text
    assert reads == [] and all(p.is_meta for p in model.parameters())  # nothing read or allocated


def test_shapes_that_differ_are_named(saved: Path) -> None:
    model = _meta_llama(intermediate_size=48)
    with pytest.raises(
        PretrainedError,
        match=r"12 with another shape: model\.layers\.0\.mlp\.gate_proj\.weight \[48, 32\] in the model vs \[64, 32\] in the checkpoint",
    ):
        load_pretrained(model, saved, device="cpu")


def test_meta_model_with_wrappers_loads_and_equals_from_pretrained(saved: Path) -> None:
    """Activation-checkpoint wrappers and a user's ``module.`` wrapper: the names still map;
    the rotary buffers (in no checkpoint) are recomputed after the meta build."""
    from transformers import AutoModelForCausalLM

    want = _logits(AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager"))
    model = _meta_llama()
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)

    class Wrapper(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    report = load_pretrained(Wrapper(model), saved, device="cpu")
    assert report.rule == "model prefix 'module.' added to the checkpoint's names"
    assert (
        report.allocated and report.tensors == 39 and report.bytes_read == report.checkpoint_bytes
    )
    assert torch.equal(_logits(model), want)


def test_base_model_from_a_causal_lm_directory(
    saved: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A LlamaModel from a LlamaForCausalLM directory: the checkpoint's ``model.`` is dropped,
    and its ``lm_head.weight`` is an error unless ``strict=False`` (then a warning)."""
    from transformers import LlamaModel

    def base() -> nn.Module:
        with torch.device("meta"):
            return LlamaModel(byo_models.tiny_llama(seed=1).config)

    with pytest.raises(PretrainedError, match=r"1 unexpected .*: lm_head\.weight"):
        load_pretrained(base(), saved, device="cpu")
    with caplog.at_level(logging.WARNING, logger="meshrun"):
        report = load_pretrained(model := base(), saved, device="cpu", strict=False)
    assert report.rule == "checkpoint prefix 'model.' dropped" and report.tensors == 38
    assert "1 checkpoint tensor(s) the model lacks are not loaded (strict=False)" in caplog.text
    full = byo_models.tiny_llama(seed=0)
    assert torch.equal(model.norm.weight, full.model.norm.weight)


def test_directory_without_safetensors_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(PretrainedError, match=r"safetensors only \(it never unpickles\)"):
        load_pretrained(nn.Linear(2, 2), tmp_path)


class WithBuffer(nn.Module):
    def __init__(self, init: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)
        if init:
            self.init_weights = self._init  # the meta-device contract parallelize uses

    def _init(self) -> None:
        self.scale.fill_(2.0)


def test_non_persistent_buffers_of_a_meta_model_are_recomputed_or_refused(tmp_path: Path) -> None:
    save_file(
        {"lin.weight": torch.eye(4), "lin.bias": torch.zeros(4)},
        str(tmp_path / "model.safetensors"),
    )
    with torch.device("meta"):
        bare, ok = WithBuffer(init=False), WithBuffer(init=True)
    with pytest.raises(PretrainedError, match=r"non-persistent buffers \['scale'\]"):
        load_pretrained(bare, tmp_path, device="cpu")
    load_pretrained(ok, tmp_path, device="cpu")
    assert torch.equal(ok.scale, torch.full((4,), 2.0)) and torch.equal(ok.lin.weight, torch.eye(4))
