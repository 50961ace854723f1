"""Mixture-of-experts FLOPs: MFU counts the parameters a token uses (plan/moe.py,
monitor/mfu.py), checked against hand counts on tiny models built from Hugging Face configs
(meta device, nothing downloaded) and on a model of the user's own that declares experts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from meshrun.monitor.mfu import model_flops
from meshrun.plan.moe import count_module, flops_per_token, read_routing

SMALL = dict(num_hidden_layers=2, num_attention_heads=4, vocab_size=64, hidden_size=32)


def _hf(kind: str, **fields: Any) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(kind, **{**SMALL, **fields})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _per_token(model: nn.Module, seq: int) -> float:
    flops = model_flops(model, 0.0)
    assert flops is not None and flops.per_token is not None
    return flops.per_token(seq)


def test_qwen3_moe_counts_top_k_of_the_routed_experts() -> None:
    model = _hf(
        "qwen3_moe",
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    # Per layer: q 32x64 + k 32x32 + v 32x32 + o 64x32 = 6,144, q/k norms 32, router 4x32 =
    # 128, experts 4 x (32x32 gate_up + 32x16 down) = 6,144, two norms 64: 12,512. Two layers
    # 25,024 + embedding 2,048 + head 2,048 + final norm 32 = 29,152.
    counted = count_module(model)
    assert (counted.total, counted.input_embedding, counted.routed) == (29152, 2048, 12288)
    # Active: all but the embedding, routed experts at 2/4: 29,152 - 2,048 - 12,288 / 2.
    assert counted.active_matmul(read_routing({"num_experts": 4, "top_k": 2})) == 20960
    # 6 x 20,960 + 12 x 2 layers x (4 heads x 16) x 32 tokens.
    assert _per_token(model, 32) == 6 * 20960 + 12 * 2 * 64 * 32 == 174912
    flops = model_flops(model, 0.0)
    assert flops is not None and "20,960 of 29,152 parameters active" in flops.source


def test_deepseek_v3_counts_shared_experts_and_dense_layers_whole() -> None:
    model = _hf(
        "deepseek_v3",
        num_key_value_heads=4,
        intermediate_size=64,
        moe_intermediate_size=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=2,
        topk_group=1,
    )
    # MLA attention 3,224 (q_a 512, its norm 16, q_b 768, kv_a 384, its norm 8, kv_b 512,
    # o 1,024) and norms 64 per layer; layer 0 dense MLP 3 x 64 x 32 = 6,144; layer 1 routed
    # 6,144 + router 128 + one shared expert 3 x 16 x 32 = 1,536. Total 24,656.
    counted = count_module(model)
    assert (counted.total, counted.routed, counted.routed_layers) == (24656, 6144, 1)
    active = 24656 - 2048 - 6144 + 6144 * 2 // 4
    # MLA's score width: heads x mean(qk 8 + 4, v 8) = 4 x 10.
    assert _per_token(model, 32) == 6 * active + 12 * 2 * 40 * 32 == 147936


@pytest.mark.parametrize(
    ("kind", "fields", "routed"),
    [
        ("mixtral", {"num_local_experts": 4, "intermediate_size": 16}, 2 * 4 * 3 * 32 * 16),
        ("olmoe", {"num_experts": 4, "intermediate_size": 16}, 2 * 4 * 3 * 32 * 16),
        (
            "qwen2_moe",
            {
                "num_experts": 4,
                "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 48,
                "intermediate_size": 64,
            },
            2 * 4 * 3 * 32 * 16,
        ),
    ],
)
def test_other_families_count_half_their_routed_experts_at_top_2_of_4(
    kind: str, fields: dict[str, Any], routed: int
) -> None:
    model = _hf(kind, num_key_value_heads=2, num_experts_per_tok=2, **fields)
    counted = count_module(model)
    assert counted.routed == routed
    active = counted.total - 64 * 32 - routed // 2
    assert _per_token(model, 16) == pytest.approx(6 * active + 12 * 2 * 32 * 16)
    # Fewer FLOPs than the same model with every expert counted.
    assert _per_token(model, 16) < 6 * (counted.total - 64 * 32) + 12 * 2 * 32 * 16


class OwnMoe(nn.Module):
    """A user's MoE: a config dict declaring the routing, experts in a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.config = {"n_layers": 2, "dim": 16, "n_heads": 2, "num_experts": 4, "top_k": 1}
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(OwnBlock() for _ in range(2))
        self.head = nn.Linear(16, 32, bias=False)


class OwnBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(16, 64, bias=False)  # q, k, v, o packed: 1,024
        self.router = nn.Linear(16, 4, bias=False)  # 64
        self.experts = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(4))  # 1,024


def test_a_users_own_model_that_declares_experts() -> None:
    model = OwnMoe()
    # 2 blocks x 2,112 + embedding 512 + head 512.
    counted = count_module(model)
    assert (counted.total, counted.input_embedding, counted.routed) == (5248, 512, 2048)
    # 2 blocks x (1,024 + 64 + 1,024 / 4 routed at top-1 of 4) + head 512 = 3,200.
    assert _per_token(model, 8) == 6 * 3200 + 12 * 2 * 16 * 8
    assert flops_per_token(3200, 2, 16, 8) == _per_token(model, 8)


def test_a_dense_model_keeps_its_formula_and_a_declaration_without_experts_counts_all() -> None:
    model = OwnMoe()
    for block in model.blocks:
        block.moe_experts = block.experts  # renamed: no module named "experts"
        del block.experts
    assert model_flops(model, 0.0) is None  # declares a routing, holds no experts: no guess
    assert read_routing({"num_experts": 1, "top_k": 1}) is None  # one expert is a dense MLP
    dense = _hf("llama", num_key_value_heads=2, intermediate_size=64)
    flops = model_flops(dense, 0.0)
    assert flops is not None and "planner formula" in flops.source
