"""Mixture-of-experts FLOPs: MFU counts the parameters a token uses (plan/moe.py,
monitor/mfu.py), checked against hand counts on tiny models built from Hugging Face configs
(meta device, nothing downloaded) and on a model of the user's own that declares experts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from meshrun.monitor.mfu import model_flops
from meshrun.plan.cost import (
    Cluster,
    Layout,
    Model,
    Training,
    all_to_all_time,
    cp_comm,
    ep_comm,
    evaluate,
    flops_per_iteration,
    model_flops_per_iteration,
)
from meshrun.plan.inputs import Moe
from meshrun.plan.memory import activation_bytes, memory
from meshrun.plan.moe import (
    a2a_bytes_per_layer,
    a2a_split,
    active_params,
    count_module,
    expert_params,
    flops_per_token,
    moe_model,
    read_routing,
)
from meshrun.plan.search import layout_problem, search

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


# --- the planner: memory, FLOPs and communication of MoE and context parallel ---------------

# 4 layers, hidden 64, 4 heads, vocab 128, seq 32; 8 experts of width 32, top-2, gated.
BASE = Model(4, 64, 4, 128, 32, ffn=128, gated_mlp=True)
TINY = moe_model(BASE, Moe(experts=8, top_k=2, expert_ffn=32))
GPU = Cluster(1, 8, 80e9, 1e15, intra_bw=100e9, inter_bw=10e9, comm_efficiency=1.0)


def test_moe_model_counts_all_experts_and_flops_count_the_active_ones() -> None:
    # Per layer: attention 4 x 64 x 64 = 16,384, norms 128, router 8 x 64 = 512, experts
    # 8 x 3 x 64 x 32 = 49,152: 66,176; x 4 = 264,704 + embedding and head 2 x 8,192 + norm 64.
    assert TINY.total_params() == 281_152
    assert expert_params(TINY) == 4 * 49_152
    assert active_params(TINY) == 281_152 - 4 * 49_152 * 6 // 8
    # Model FLOPs of one sequence: 32 tokens x (6 x (blocks 264,704 - 3/4 of the experts
    # 147,456 + output layer 8,192) + 12 x 4 layers x 64 x 32).
    assert model_flops_per_iteration(TINY, 1) == 32 * (6 * (264_704 - 147_456 + 8_192) + 98_304)
    # Full recomputation: the blocks' forward again (4/3 of them), not the output layer.
    blocks = 32 * (6 * (264_704 - 147_456) + 98_304)
    assert flops_per_iteration(TINY, 1, "full") == pytest.approx(blocks * 4 / 3 + 32 * 6 * 8_192)
    # A capacity factor of 1.5 pads the routed slots: hardware FLOPs, not model FLOPs.
    padded = replace_moe(capacity_factor=1.5)
    routed = 4 * 49_152 * 2 / 8
    assert flops_per_iteration(padded, 1) - flops_per_iteration(TINY, 1) == 32 * 6 * routed * 0.5
    assert model_flops_per_iteration(padded, 1) == model_flops_per_iteration(TINY, 1)


def replace_moe(**fields: float) -> Model:
    from dataclasses import replace

    assert TINY.moe is not None
    return replace(TINY, moe=replace(TINY.moe, **fields))


def test_expert_parallel_splits_the_experts_memory_and_nothing_else() -> None:
    t = Training(global_batch=8, precision="bf16", optimizer="adamw")
    one, two = (memory(TINY, Layout(dp_shard=8, ep=ep), t, GPU, 8) for ep in (1, 8))
    # DDP (zero 0): 2 + 2 + 12 bytes per parameter; ep = 8 keeps 1/8 of the 196,608 experts.
    assert one.params - two.params == 2 * 196_608 * 7 / 8
    assert one.optimizer - two.optimizer == 12 * 196_608 * 7 / 8
    assert one.activations == two.activations


def test_the_all_to_all_volume_and_time_by_hand() -> None:
    lay = Layout(dp_shard=8, ep=4, micro_batch=2)
    # 2 x 32 tokens x 64 hidden x top-2 x 2 bytes x 3/4 leave a rank per all-to-all.
    assert a2a_bytes_per_layer(TINY, lay, 2) == 2 * 32 * 64 * 2 * 2 * 3 / 4
    t = Training(global_batch=16)  # 1 micro-batch per step
    # Inside a node: 4 all-to-alls per layer x 4 layers, at 100 GB/s, no latency.
    assert ep_comm(TINY, lay, t, GPU, 1) == pytest.approx(16 * 12288 / 100e9)
    # Across nodes (2 GPUs per node): 1 of the 3 others is local, 2/3 of the bytes go at 10 GB/s.
    two_per_node = Cluster(4, 2, 80e9, 1e15, intra_bw=100e9, inter_bw=10e9, comm_efficiency=1.0)
    assert all_to_all_time(two_per_node, 4, 1, 6144) == pytest.approx(6144 * 2 / 3 / 10e9)
    # ep 4 over 2 nodes: a rank sends 1.5 token copies (2 slots x 3/4); a plain all-to-all
    # sends 2/3 of them to the other node (1 copy), DeepEP the token once if one of its 2
    # experts is there: 1 - (1/2)^2 = 3/4 of a copy, every copy over the node's links.
    copy = 2 * 32 * 64 * 2
    assert a2a_split(TINY, lay, 2, 2, dedupe=False) == (copy * 0.5, copy * 1.0)
    assert a2a_split(TINY, lay, 2, 2, dedupe=True) == (copy * 1.5, copy * 0.75)
    # A dense model has no all-to-all; ep on it is refused, as is ep not dividing the experts.
    assert ep_comm(BASE, lay, t, GPU, 1) == 0.0
    assert "mixture-of-experts" in str(layout_problem(BASE, lay, t, GPU))
    bad = Layout(dp_shard=8, ep=3, micro_batch=2)
    assert "does not divide the 8 experts" in str(layout_problem(TINY, bad, t, GPU))


def test_context_parallel_divides_activations_and_passes_kv_around_the_ring() -> None:
    t = Training(global_batch=8)
    one, two = (Layout(dp_shard=8 // cp, cp=cp) for cp in (1, 2))
    assert activation_bytes(BASE, one, t, 1) == pytest.approx(2 * activation_bytes(BASE, two, t, 1))
    # Ring: K/V chunk 16 tokens x 2 x 4 kv heads x 16 dims x 2 bytes = 4,096 bytes, 3 sends
    # per layer (1 forward, 2 backward), 4 layers; the attention math hides 12 x 16 x 32 x 64
    # FLOPs per layer: on a slow link what is left is exposed.
    slow = Cluster(1, 8, 80e9, 1e12, intra_bw=1e6, inter_bw=1e6, comm_efficiency=1.0)
    math_s = 12 * 16 * 32 * 64 / (1e12 * 0.5)
    assert cp_comm(BASE, two, t, slow, 1) == pytest.approx(4 * (3 * 4096 / 1e6 - math_s))
    slow_math = Cluster(1, 8, 80e9, 1e9, intra_bw=100e9, inter_bw=10e9)
    assert cp_comm(BASE, two, t, slow_math, 1) == 0.0  # the sends hide behind the math
    # Ulysses: 4 all-to-alls forward, 4 backward of (cp-1)/cp of the rank's q/k/v/out.
    uly = Training(global_batch=8, cp_attention="ulysses")
    sent = 2 * 16 * (2 * 4 + 2 * 4) * 16 * 2 / 2
    assert cp_comm(BASE, two, uly, slow, 1) == pytest.approx(4 * sent / 1e6)
    odd = Model(4, 64, 4, 128, 30, ffn=128)
    assert "divisible by 2 x cp" in str(layout_problem(odd, two, t, GPU))


def test_search_tries_expert_parallel_for_an_moe_model_only() -> None:
    t = Training(global_batch=64)
    moe = search(TINY, t, GPU, (1, 2), ("none",))
    assert {e.layout.ep for e in moe.estimates} == {1, 2, 4, 8}
    dense = search(BASE, t, GPU, (1, 2), ("none",))
    assert {e.layout.ep for e in dense.estimates} == {1}
    assert {e.layout.cp for e in search(BASE, t, GPU, (1,), ("none",), cps=(1, 2)).estimates} == {
        1,
        2,
    }
    best = evaluate(TINY, Layout(dp_shard=8, ep=8, micro_batch=8), t, GPU)
    assert best.time is not None and best.time.ep_comm > 0 and best.fits


def test_meshrun_plan_shows_ep_and_cp_columns(capsys: pytest.CaptureFixture[str]) -> None:
    from meshrun.cli.main import main

    shape = "--layers 4 --hidden 64 --heads 4 --vocab 128 --seq 32 --ffn 128 --mlp gated"
    moe = "--experts 8 --top-k 2 --expert-ffn 32 --capacity-factor 1.25"
    argv = ["plan", *shape.split(), *moe.split(), "--gpus-per-node", "4", "--global-batch", "8"]
    assert main([*argv, "--ep", "4", "--cp", "2", "--top", "3"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "dp_shard" in line)
    assert " ep " in header and " cp " in header
    assert main([*argv, "--layout", "dp_shard=2,cp=2,ep=4", "--json"]) == 0
    (layout,) = json.loads(capsys.readouterr().out)["layouts"]
    assert (layout["ep"], layout["cp"]) == (4, 2) and layout["step_time_breakdown_s"]["ep_comm"] > 0
    assert main([*argv[:13], "--experts", "8", "--top-k", "9", "--expert-ffn", "32"]) == 2
    assert "1 <= top-k <= experts" in capsys.readouterr().err


def test_meshrun_plan_model_reads_an_hf_moe_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshrun.cli.main import main

    config = {
        "model_type": "qwen3_moe",
        **SMALL,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["plan", "--no-trace", "--model", str(tmp_path), "--seq", "16", "--gpus-per-node", "4"]
    assert main([*argv, "--global-batch", "8", "--json", "--top", "0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["params"] == 29152 and doc["model"]["moe"]["expert_params"] == 12288
    assert {"experts": 4, "top_k": 2, "expert_ffn": 16}.items() <= doc["model"]["moe"].items()
    assert any(lay["ep"] > 1 for lay in doc["layouts"])
