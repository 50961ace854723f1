"""The pure parts of the tensor-parallel plan checks, without processes: which split layers
make a plan split an attention (only then must tp divide the heads), the meta copy, the
derived input, and the explanation of an error raised in the user's forward (the runs on 2
ranks are tests/dist/test_tp_forward_check.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshrun.config import ConfigError
from meshrun.demo.model import GPT, GPTConfig
from meshrun.parallel.tp import attention_modules, check_tp_plan, default_tp_plan
from meshrun.parallel.tp_check import (
    derive_input,
    explain,
    isolated_rng,
    meta_copy,
    note_first_forward,
    run_forward_backward,
)


class Attention(nn.Module):
    def __init__(self, dim: int = 16, n_heads: int = 4, local: int = 1) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim // local)  # local > 1: the shard one rank holds
        self.wo = nn.Linear(dim // local, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.size()
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)  # the line named
        return self.wo(q.flatten(2))


class Model(nn.Module):
    def __init__(self, local: int = 1) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.layers = nn.ModuleList([Attention(local=local)])
        self.head = nn.Linear(16, 10)
        self.head.weight = self.emb.weight

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


PLAN = {"layers.0.wq": ColwiseParallel(), "layers.0.wo": RowwiseParallel()}
LINE = next(
    i
    for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
    if "# the line named" in line
)


def test_only_a_plan_that_splits_an_attention_needs_the_heads_divided() -> None:
    gpt = GPT(GPTConfig(seq_len=8, n_layer=1, n_head=3, d_model=48))  # 3 heads, tp = 2
    mlp_only = {"blocks.*.mlp.up": ColwiseParallel(), "blocks.*.mlp.down": RowwiseParallel()}
    assert attention_modules(gpt, {"blocks.0.mlp.up": 0, "lm_head": 0}) == set()
    check_tp_plan(gpt, mlp_only, 2)  # the attention stays whole on every rank
    assert attention_modules(gpt, default_tp_plan(gpt)) == {"blocks.0.attn"}
    with pytest.raises(ConfigError, match=r"tp = 2 does not divide blocks.0.attn.n_head = 3"):
        check_tp_plan(gpt, default_tp_plan(gpt), 2)


def test_the_meta_copy_allocates_nothing_and_keeps_ties() -> None:
    model = Model()
    copy = meta_copy(model)
    assert copy is not None
    assert all(t.is_meta for t in [*copy.parameters(), *copy.buffers()])
    assert copy.head.weight is copy.emb.weight and isinstance(copy.head.weight, nn.Parameter)
    assert not any(t.is_meta for t in model.parameters())  # the model is untouched
    (ids,) = derive_input(model, 2) or (None,)
    assert ids is not None and ids.shape == (2, 4) and ids.dtype == torch.long and ids.is_meta
    assert derive_input(nn.Sequential(nn.Linear(4, 4)), 2) is None  # no token ids to derive


def test_a_forward_on_meta_sets_no_gradient_and_draws_no_random_number() -> None:
    model = meta_copy(Model())
    assert model is not None
    before = torch.get_rng_state()
    with isolated_rng():
        torch.rand(3)  # a draw inside is undone
        assert run_forward_backward(model, derive_input(model, 2) or ()) is None
    assert torch.equal(before, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_an_error_in_the_split_forward_names_the_module_the_line_and_the_fix() -> None:
    shard = meta_copy(Model(local=2))  # what one of 2 ranks holds after a column-wise split
    assert shard is not None
    error = run_forward_backward(shard, derive_input(shard, 2) or ())
    assert isinstance(error, RuntimeError)
    why = explain(error, shard, PLAN, 2)
    assert why.startswith(
        f"tensor parallel over 2 ranks breaks the forward of layers.0 (Attention, {__file__}:"
        f"{LINE}: `q = self.wq(x).view(b, s, self.n_heads, self.head_dim)  # the line named`): "
        "RuntimeError: shape '[2, 4, 4, 4]' is invalid for input of size 64; the plan splits "
        "wq column-wise, so each rank holds 1/2 of their output features"
    ), why
    assert "-1 in place of the head count" in why and "n_heads // tp" in why


def test_the_first_forward_error_gets_the_explanation_as_a_note() -> None:
    model = Model(local=2)
    handles = note_first_forward(model, PLAN, 2)
    with pytest.raises(RuntimeError) as info:
        model(torch.zeros(2, 4, dtype=torch.long))
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and notes[0].startswith(
        "meshrun: tensor parallel over 2 ranks breaks the forward of layers.0 (Attention"
    ), notes
    whole = Model()
    handles = note_first_forward(whole, PLAN, 2)
    whole(torch.zeros(2, 4, dtype=torch.long))  # a success removes the hook
    assert not whole.layers[0]._forward_hooks and len(handles) == 1
