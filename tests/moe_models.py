"""Tiny mixture-of-experts models for the expert-parallel tests: Hugging Face Qwen2-MoE (with a
sigmoid-gated shared expert), Mixtral, OLMoE and Qwen3-MoE built from configs (nothing
downloaded), and a model of our own whose experts are a ``ModuleList`` declared with
``ModelSpec(experts=...)``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K, SEQ = 64, 32, 2, 4, 2, 16
OWN_EXPERTS = "layers.*.moe.experts"  # the pattern a user passes in ModelSpec(experts=...)


def _common() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "num_experts_per_tok": TOP_K,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
    }


def tiny_qwen2_moe(num_experts: int = EXPERTS, seed: int = 0) -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        **_common(),
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=num_experts,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return Qwen2MoeForCausalLM(cfg)


def tiny_mixtral(num_experts: int = EXPERTS, seed: int = 0) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**_common(), intermediate_size=16, num_local_experts=num_experts)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return MixtralForCausalLM(cfg)


def tiny_olmoe(num_experts: int = EXPERTS, seed: int = 0) -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    cfg = OlmoeConfig(**_common(), intermediate_size=16, num_experts=num_experts)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return OlmoeForCausalLM(cfg)


def tiny_qwen3_moe(num_experts: int = EXPERTS, seed: int = 0) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **_common(),
        intermediate_size=32,
        moe_intermediate_size=16,
        num_experts=num_experts,
        norm_topk_prob=True,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg)


class OwnExperts(nn.Module):
    """A ``ModuleList`` of MLP experts with the container call contract:
    ``forward(x [N, H], idx [N, K], w [N, K]) -> [N, H]``."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, 24), nn.GELU(), nn.Linear(24, HIDDEN))
            for _ in range(num_experts)
        )

    def forward(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, slot, None])
        return out


class OwnMoE(nn.Module):
    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, num_experts, bias=False)
        self.experts = OwnExperts(num_experts)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat).float(), dim=-1)
        w, idx = torch.topk(probs, TOP_K, dim=-1)
        out = self.experts(flat, idx, (w / w.sum(-1, keepdim=True)).to(x.dtype))
        return out.view_as(x)


class OwnBlock(nn.Module):
    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.moe = OwnMoE(num_experts)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.moe(self.norm(x))


class OwnMoEModel(nn.Module):
    """Embedding, MoE blocks, head: a language model whose MoE layers are its own."""

    def __init__(self, num_experts: int = EXPERTS) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(OwnBlock(num_experts) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def tiny_own(num_experts: int = EXPERTS, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return OwnMoEModel(num_experts)


BUILDERS = {"qwen2_moe": tiny_qwen2_moe, "mixtral": tiny_mixtral, "own": tiny_own}
# Two more Hugging Face families for the heavy variants (tests/dist/test_ep.py)
MORE_BUILDERS = {"olmoe": tiny_olmoe, "qwen3_moe": tiny_qwen3_moe}


def logits_of(model: nn.Module, idx: Tensor) -> Tensor:
    out = model(idx)
    return out.logits if hasattr(out, "logits") else out


def loss_of(model: nn.Module, tokens: Tensor) -> Tensor:
    logits = logits_of(model, tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


class Tokens(Dataset[Tensor]):
    """Fixed random token windows (seed 0) of SEQ + 1 tokens: inputs and shifted targets."""

    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, 16, (n, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Tensor:
        return self.data[i]
