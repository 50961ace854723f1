"""The demo GPT: shapes, initial loss, learning, determinism, counting, config validation."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from meshrun.demo.model import GPT, Attention, GPTConfig, demo_config


def _tiny(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(demo_config("tiny"))


def _batch(cfg: GPTConfig, batch: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def test_presets() -> None:
    tiny = demo_config("tiny")
    assert (tiny.n_layer, tiny.d_model, tiny.n_head, tiny.seq_len) == (2, 64, 2, 32)
    assert demo_config() == GPTConfig()
    assert demo_config("small") is not demo_config("small")  # callers may edit their copy
    with pytest.raises(ValueError, match="huge"):
        demo_config("huge")


def test_output_shapes() -> None:
    model = _tiny()
    idx, targets = _batch(model.cfg, batch=3)
    assert model(idx).shape == (3, model.cfg.seq_len, 256)
    assert model(idx[:, :5]).shape == (3, 5, 256)  # shorter sequences are fine
    loss = model(idx, targets)
    assert loss.shape == () and loss.dtype == torch.float32


def test_causal() -> None:
    # Changing a later byte must not change the logits at any earlier position.
    model = _tiny()
    idx, _ = _batch(model.cfg, batch=1)
    changed = idx.clone()
    changed[0, 20] = (idx[0, 20] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_too_long_sequence_rejected() -> None:
    model = _tiny()
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, model.cfg.seq_len + 1, dtype=torch.long))


def test_initial_loss_is_uniform() -> None:
    model = _tiny()
    loss = model(*_batch(model.cfg)).item()
    assert abs(loss - math.log(256)) < 0.3


def test_overfits_fixed_batch() -> None:
    model = _tiny()
    idx, targets = _batch(model.cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = model(idx, targets).item()
    for _ in range(30):
        loss = model(idx, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < first - 2.0


def test_same_seed_same_parameters() -> None:
    a, b, c = _tiny(seed=0), _tiny(seed=0), _tiny(seed=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.blocks[0].attn.q.weight, c.blocks[0].attn.q.weight)


def test_init_weights_after_meta_materialisation() -> None:
    # Every parameter must be set by init_weights, or to_empty's garbage would survive.
    cfg = demo_config("tiny")
    ref = GPT(cfg)
    torch.manual_seed(7)
    ref.init_weights()
    with torch.device("meta"):
        meta = GPT(cfg)
    meta = meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.init_weights()
    for (name, p), q in zip(ref.named_parameters(), meta.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_residual_projections_scaled() -> None:
    model = GPT(GPTConfig(n_layer=8))  # large enough for stds to be measured well
    expected = 0.02 / math.sqrt(2 * 8)
    assert model.blocks[0].mlp.down.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert model.blocks[0].attn.q.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.lm_head.weight.data_ptr() != model.tok_emb.weight.data_ptr()  # untied


def test_attention_works_with_sharded_heads() -> None:
    # Split q/k/v column-wise and proj row-wise, as tensor parallelism would: each half holds
    # one head, and the two partial outputs must add up to the full attention output.
    torch.manual_seed(0)
    cfg = demo_config("tiny")
    attn = Attention(cfg)
    x = torch.randn(2, cfg.seq_len, cfg.d_model)
    half = cfg.d_model // 2
    partial = []
    for rank in range(2):
        shard = copy.deepcopy(attn)
        cols = slice(rank * half, (rank + 1) * half)
        for name in ("q", "k", "v"):
            full: nn.Linear = getattr(shard, name)
            part = nn.Linear(cfg.d_model, half, bias=False)
            part.weight.data.copy_(full.weight[cols])
            setattr(shard, name, part)
        proj = nn.Linear(half, cfg.d_model, bias=False)
        proj.weight.data.copy_(attn.proj.weight[:, cols])
        shard.proj = proj
        partial.append(shard(x))
    torch.testing.assert_close(partial[0] + partial[1], attn(x))


def test_num_params_counts_every_parameter() -> None:
    model = _tiny()
    total = sum(p.numel() for p in model.parameters())
    assert model.num_params() == total
    emb = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    assert model.num_params(exclude_embeddings=True) == total - emb
    cfg = model.cfg
    attn_flops = 12 * cfg.n_layer * cfg.d_model * cfg.seq_len
    assert model.flops_per_token() == 6 * (total - emb) + attn_flops


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"d_model": 65, "n_head": 2}, "d_model"),
        ({"n_layer": 0}, "n_layer"),
        ({"n_head": -1}, "n_head"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"seq_len": 2.5}, "seq_len"),
        ({"ffn_mult": 0}, "ffn_mult"),
        ({"dropout": 1.0}, "dropout"),
        ({"bias": "no"}, "bias"),
    ],
)
def test_config_validation(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field}="):
        GPTConfig(**kwargs)  # type: ignore[arg-type]
