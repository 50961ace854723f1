"""Pipeline refusals on a model shaped like pytorch/examples' word_language_model Transformer
name the real reason and a fix that works.

That model subclasses ``nn.Transformer``, whose ``__init__`` registers ``encoder`` (the blocks)
first; the subclass then adds its positional encoding and its embedding, and replaces
``decoder`` by the head. meshrun reads the registration order as the forward's, so it finds the
blocks but nothing before them: the refusal must say so (not blame the blocks) and point to
``ModelSpec(before=..., after=...)``. With the order given, a forward that scales the
embedding, passes a mask and ends in ``log_softmax`` still differs from the chain of modules
the stages rebuild: that refusal must say what the stages run and that no ModelSpec can
describe the extra work. A forward that is the chain splits with the ModelSpec.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshrun.config import ConfigError
from meshrun.parallel.pp.split import split_model
from meshrun.parallel.pp.stages import StageModule, check_stages_reproduce
from meshrun.parallel.structure import ModelSpec, find_structure


class PositionalEncoding(nn.Module):
    """Sinusoidal positions added to the embeddings (a buffer, no parameters)."""

    def __init__(self, d: int, max_len: int = 64) -> None:
        super().__init__()
        pos = torch.arange(max_len).unsqueeze(1)
        freq = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        table = torch.zeros(max_len, d)
        table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
        self.register_buffer("table", table)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.table[: x.size(1)]


class TransformerLM(nn.Transformer):
    """word_language_model's shape: nn.Transformer's encoder, then the embedding and head."""

    def __init__(self, chain: bool = False, vocab: int = 40, d: int = 16) -> None:
        super().__init__(
            d_model=d,
            nhead=2,
            dim_feedforward=32,
            num_encoder_layers=2,
            num_decoder_layers=1,
            dropout=0.0,
            batch_first=True,
        )
        self.pos_encoder = PositionalEncoding(d)
        self.input_emb = nn.Embedding(vocab, d)
        self.d = d
        self.decoder = nn.Linear(d, vocab)  # replaces nn.Transformer's decoder, as the example
        self.chain = chain

    def forward(self, src: Tensor) -> Tensor:  # type: ignore[override]
        if self.chain:  # exactly the modules in a row
            return self.decoder(self.encoder(self.pos_encoder(self.input_emb(src))))
        x = self.pos_encoder(self.input_emb(src) * math.sqrt(self.d))
        mask = nn.Transformer.generate_square_subsequent_mask(src.size(1))
        return F.log_softmax(self.decoder(self.encoder(x, mask=mask, is_causal=True)), dim=-1)


ORDER = ModelSpec(before=("input_emb", "pos_encoder"), after=("encoder.norm", "decoder"))


def stages_of(model: nn.Module, spec: ModelSpec | None, n: int = 2) -> list[StageModule]:
    split = split_model(model, find_structure(model, spec), n)
    return [StageModule(model, parts) for parts in split.parts]


def test_registration_order_refusal_names_the_order_not_the_blocks() -> None:
    torch.manual_seed(0)
    with pytest.raises(ConfigError) as e:
        stages_of(TransformerLM(), None)
    why = str(e.value)
    assert (
        "parallel.pp: TransformerLM's blocks encoder.layers (2 x TransformerEncoderLayer) were "
        "found, but input_emb (nn.Embedding) is registered after them" in why
    ), why
    assert "spec=ModelSpec(before=('input_emb', ...), after=(...))" in why, why
    assert "encoder.norm, decoder, pos_encoder, input_emb" in why, why  # what to choose from
    assert "ModelSpec(blocks=" not in why  # the blocks were found


def test_a_forward_that_is_not_the_chain_is_refused_with_what_the_stages_run() -> None:
    torch.manual_seed(0)
    model = TransformerLM()
    with pytest.raises(ConfigError) as e:
        check_stages_reproduce(model, stages_of(model, ORDER))
    why = str(e.value)
    chain = "input_emb -> pos_encoder -> encoder.layers.* -> encoder.norm -> decoder"
    assert chain in why and "no ModelSpec can describe it" in why, why
    assert "a mask or other arguments passed to the blocks" in why and "parallel.pp=1" in why
    assert "give the structure (ModelSpec) that matches it" not in why


def test_the_order_given_by_modelspec_splits_a_chain_forward() -> None:
    torch.manual_seed(0)
    model = TransformerLM(chain=True)
    stages = stages_of(model, ORDER)
    assert [s.meshrun_parts.before for s in stages] == [("input_emb", "pos_encoder"), ()]
    assert stages[-1].meshrun_parts.after == ("encoder.norm", "decoder")
    assert check_stages_reproduce(model, stages).startswith("values on a probe batch")


def test_modelspec_ends_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"ModelSpec\(before=\('emb',\)\): \['emb'\] is not"):
        find_structure(TransformerLM(), ModelSpec(before=("emb",)))
