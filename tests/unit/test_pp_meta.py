"""Pipeline stages of a model built on the meta device, in one process: the split's check runs on
fake tensors (shapes and dtypes) and refuses stages whose logits have another shape; a stage
allocated and initialised alone holds real values and the rotary tables of the model built on
CPU, while the other stages stay on meta; a meta model without an initialiser is refused."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from byo_models import NanoGPT, tiny_llama
from meshrun.config import ConfigError
from meshrun.parallel.pp.meta import materialize_stages, stage_initializer
from meshrun.parallel.pp.split import split_model
from meshrun.parallel.pp.stages import StageModule, check_stages_reproduce, hf_context
from meshrun.parallel.structure import find_structure, is_hf_model


def stages_of(model: nn.Module, n: int = 2) -> list[StageModule]:
    s = find_structure(model)
    kwargs, shared = hf_context(model, s.block_names()) if is_hf_model(model) else (None, ())
    return [StageModule(model, p, kwargs) for p in split_model(model, s, n, shared).parts]


def test_meta_split_is_checked_for_shapes_and_says_so() -> None:
    with torch.device("meta"):
        model = tiny_llama(tie_word_embeddings=True)
    checked = check_stages_reproduce(model, stages_of(model))
    assert checked.startswith("shapes only") and "meta device" in checked


class HalfHead(NanoGPT):
    """A forward that returns half the vocabulary: other logits than the stages give."""

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, None]:
        logits, _ = super().forward(idx)
        return logits[..., : logits.shape[-1] // 2], None


def test_meta_split_with_other_logit_shapes_is_refused() -> None:
    with torch.device("meta"):
        model = HalfHead()
    with pytest.raises(ConfigError, match="give logits of shape"):
        check_stages_reproduce(model, stages_of(model))


def test_one_stage_is_allocated_and_its_rotary_table_recomputed() -> None:
    with torch.device("meta"):
        model = tiny_llama()
    stages = stages_of(model)
    materialize_stages([stages[1]], torch.device("cpu"), stage_initializer(model))
    assert all(not p.is_meta for p in stages[1].parameters())
    assert all(p.is_meta for p in stages[0].parameters())  # the other rank's stage: no memory
    real = tiny_llama()
    got = stages[1].get_submodule("model.rotary_emb").inv_freq
    assert torch.equal(got, real.model.rotary_emb.inv_freq)
    head = stages[1].get_submodule("lm_head").weight.detach()
    assert bool(torch.isfinite(head).all()) and float(head.std()) > 0


class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def test_a_meta_model_without_an_initialiser_is_refused() -> None:
    with torch.device("meta"):
        model = NoInit()
    with pytest.raises(TypeError, match="has no init_weights"):
        stage_initializer(model)
