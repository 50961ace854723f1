"""Models meshrun did not write, for the bring-your-own-model tests: built from configs, nothing
downloaded.

- :class:`NanoGPT`: a GPT with the names and structure of nanoGPT's ``model.py``
  (``transformer.wte/wpe/drop/h/ln_f``, a fused ``attn.c_attn``, ``mlp.c_fc``/``mlp.c_proj``,
  ``lm_head`` tied to ``wte``), written for these tests. Its ``forward(idx, targets=None)``
  returns ``(logits, loss)`` as nanoGPT's does (logits for every position here).
- :func:`tiny_llama`, :func:`tiny_qwen2`, :func:`tiny_gpt2`: Hugging Face causal LMs from tiny
  configs (fp32, no dropout, eager attention), seeded.
- :func:`logits_of`: the logits of any of them for ``idx``, so a test's loss is one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 96
SEQ = 16


@dataclass
class NanoGPTConfig:
    block_size: int = SEQ
    vocab_size: int = VOCAB
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: NanoGPTConfig) -> None:
        super().__init__()
        # q, k and v in one projection: the layout nanoGPT and GPT-2 checkpoints use.
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.dropout = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: NanoGPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: NanoGPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, cfg: NanoGPTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or NanoGPTConfig()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg.vocab_size, cfg.n_embd),
                "wpe": nn.Embedding(cfg.block_size, cfg.n_embd),
                "drop": nn.Dropout(cfg.dropout),
                "h": nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                "ln_f": nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            }
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # scaled residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def _hf_common() -> dict[str, Any]:
    return {"vocab_size": VOCAB, "attn_implementation": "eager", "dtype": torch.float32}


def tiny_llama(num_key_value_heads: int = 2, seed: int = 0, **overrides: Any) -> nn.Module:
    """LlamaForCausalLM, 4 layers, hidden 32, 4 heads, grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kw: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**(_hf_common() | kw | overrides)))


def tiny_qwen2(seed: int = 0, **overrides: Any) -> nn.Module:
    """Qwen2ForCausalLM, 4 layers, grouped-query attention with bias on q/k/v."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    kw: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    }
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**(_hf_common() | kw | overrides)))


def tiny_gpt2(seed: int = 0, **overrides: Any) -> nn.Module:
    """GPT2LMHeadModel: Conv1D projections, fused c_attn, tied head, no TP/PP plan."""
    from transformers import GPT2Config, GPT2LMHeadModel

    kw: dict[str, Any] = {
        "n_embd": 32,
        "n_layer": 4,
        "n_head": 4,
        "n_positions": 64,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,  # GPT-2's 50256 lies outside the tiny vocabulary
        "eos_token_id": 0,
    }
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**(_hf_common() | kw | overrides)))


def logits_of(model: nn.Module, idx: Tensor) -> Tensor:
    """Logits for ``idx`` from a NanoGPT, a Hugging Face causal LM (or a wrapper around one)."""
    out = model(idx)
    if isinstance(out, tuple):
        return out[0]
    return out.logits if hasattr(out, "logits") else out
