"""The tensor-parallel plan checks on torch's own attention and on dims tp does not divide,
without processes (the training runs are tests/dist/test_tp_torch_shapes.py)."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshrun.config import ConfigError
from meshrun.parallel.structure import find_structure
from meshrun.parallel.tp import check_tp_plan, resolve_tp_plan, uneven_split_ok


class EncoderLM(nn.Module):
    def __init__(self, vocab: int = 97, d: int = 24, heads: int = 3, ff: int = 48) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab, bias=False)


MLP = {"encoder.layers.*.linear1": "colwise", "encoder.layers.*.linear2": "rowwise"}


def test_torch_attention_is_refused_with_the_feed_forward_plan() -> None:
    model = EncoderLM()
    structure = find_structure(model)
    with pytest.raises(ConfigError) as e:
        check_tp_plan(model, resolve_tp_plan(model, structure), 2, structure)
    why = str(e.value)
    assert why.startswith(
        "tensor parallel cannot split encoder.layers.0.self_attn (torch's nn.MultiheadAttention; "
        "the plan splits encoder.layers.0.self_attn.out_proj)"
    ), why
    assert f"run.parallelize(model, tp_plan={MLP})" in why, why


def test_the_feed_forward_plan_needs_no_division_of_the_attention_heads() -> None:
    # 3 heads, tp = 2: the attention stays whole on every rank, so its heads need not divide.
    model = EncoderLM(heads=3)
    check_tp_plan(model, MLP, 2)
    with pytest.raises(ConfigError, match=r"does not divide encoder.layers.0.linear1.out_feat"):
        check_tp_plan(EncoderLM(ff=51), MLP, 2)  # a local shard handed on: features must divide


def test_an_odd_vocabulary_splits_where_the_shards_stay_dtensors() -> None:
    model = EncoderLM(vocab=97, heads=4)
    gathered = {"head": "colwise_gather_output", "emb": "embedding_rowwise", **MLP}
    check_tp_plan(model, gathered, 2)  # 97 rows: 49 + 48
    with pytest.raises(ConfigError, match=r"tp = 2 does not divide head.out_features = 97"):
        check_tp_plan(model, {"head": "colwise"}, 2)  # a local shard handed on: must divide
    assert uneven_split_ok(ColwiseParallel(output_layouts=Replicate()))
    assert uneven_split_ok(ColwiseParallel(use_local_output=False))
    assert uneven_split_ok(RowwiseParallel(input_layouts=Replicate()))
    assert not uneven_split_ok(ColwiseParallel()) and not uneven_split_ok(RowwiseParallel())
