"""A small byte-level GPT for meshrun's demo.

The model is GPT-2 shaped (pre-norm residual blocks, learned positions, GELU MLP) and reads
raw bytes, so it needs no tokenizer and no download. It is written with the parallelisms in
mind, without depending on any of them:

- ``q``, ``k``, ``v`` and ``proj`` are separate ``nn.Linear`` layers, so a tensor-parallel plan
  can split ``q``/``k``/``v`` column-wise and ``proj`` row-wise. The number of heads a rank
  holds is read from the shape of the ``q`` output at forward time, never from the config.
- ``lm_head`` is not tied to ``tok_emb``: tied weights would have to share one sharding.
- There are no registered buffers (causality comes from ``is_causal=True``), and all
  initialisation lives in ``init_weights()``, so a model built on the meta device can be
  materialised with ``to_empty()`` and initialised afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class GPTConfig:
    """Shape of the demo GPT. The defaults are the "small" preset (about 3.3M parameters)."""

    vocab_size: int = 256  # one token per byte
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    ffn_mult: int = 4
    dropout: float = 0.0
    bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "ffn_mult"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be a positive integer")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model}: must be divisible by n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r}: must be in [0, 1)")
        if not isinstance(self.bias, bool):
            raise ValueError(f"GPTConfig.bias={self.bias!r}: must be True or False")


_PRESETS: dict[str, GPTConfig] = {
    # Small enough for unit tests to train in a fraction of a second.
    "tiny": GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=64),
    "small": GPTConfig(),
}


def demo_config(size: str = "small") -> GPTConfig:
    """Return a fresh copy of a named preset: "tiny" (tests) or "small" (the demo default)."""
    if size not in _PRESETS:
        raise ValueError(f"demo_config size={size!r}: expected one of {sorted(_PRESETS)}")
    return replace(_PRESETS[size])  # a copy, so callers can edit it freely


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v/proj layers (see module docstring).

    ``sdpa`` is the seam context parallel replaces (meshrun/parallel/cp.py): it is called as
    ``F.scaled_dot_product_attention`` and must attend over the whole sequence."""

    sdpa = staticmethod(F.scaled_dot_product_attention)

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head  # global head count; a TP shard holds fewer
        self.head_dim = cfg.d_model // cfg.n_head
        self.dropout = cfg.dropout
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        # The -1 lets the head count follow the actual width of q's output: all n_head heads
        # on one device, n_head / tp heads when q/k/v have been split column-wise.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H_local, T, hd)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = self.sdpa(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # back to (B, T, H_local * hd)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: up-projection, GELU, down-projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.ffn_mult * cfg.d_model, bias=cfg.bias)
        self.act = nn.GELU()
        self.down = nn.Linear(cfg.ffn_mult * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.down(self.act(self.up(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Byte-level GPT: embeddings, ``n_layer`` blocks, final norm, untied ``lm_head``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from the global torch RNG, GPT-2 style.

        Weights are N(0, 0.02). The two projections that write into the residual stream
        (``attn.proj`` and ``mlp.down``) get std 0.02 / sqrt(2 * n_layer), so the stream's
        variance does not grow with depth (GPT-2 paper, section 2.3). Call this again after
        ``to_empty()`` when the model was built on the meta device.
        """
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_resid = name.endswith(("attn.proj", "mlp.down"))
                nn.init.normal_(module.weight, mean=0.0, std=resid_std if is_resid else 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Logits (B, T, vocab_size) for ``idx`` (B, T), or the mean cross-entropy vs ``targets``.
        ``position_ids`` (1 or B, T): the tokens' places when ``idx`` is a slice of a longer
        sequence (context parallel); default ``0 .. T-1``."""
        n_pos = idx.shape[1]
        if n_pos > self.cfg.seq_len:
            raise ValueError(
                f"sequence length {n_pos} exceeds GPTConfig.seq_len={self.cfg.seq_len}"
            )
        pos = torch.arange(n_pos, device=idx.device) if position_ids is None else position_ids
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count; with ``exclude_embeddings`` leave out ``tok_emb`` and ``pos_emb``.

        ``lm_head`` always counts: it is untied, and unlike a lookup it is a real matmul.
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel() + self.pos_emb.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token (forward + backward) at full sequence length.

        The usual estimate from the PaLM paper (Chowdhery et al. 2022, appendix B), also used
        by nanoGPT's ``estimate_mfu``: 6 * N for the matmuls over the N non-embedding
        parameters, plus 12 * n_layer * d_model * seq_len for the attention scores and their
        weighted sum.
        """
        n = self.num_params(exclude_embeddings=True)
        return 6 * n + 12 * self.cfg.n_layer * self.cfg.d_model * self.cfg.seq_len
