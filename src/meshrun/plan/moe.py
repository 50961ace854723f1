"""Mixture-of-experts in the cost model (pure; torch imported lazily, only to count a built
model): which parameters a token uses, the FLOPs that counts, the experts' memory and
activations, and expert parallel's all-to-all. docs/plan.md ("Mixture of experts") derives it.

- Active parameters: a token runs the dense parts, the shared experts and ``top_k`` of the
  ``experts`` routed ones, so the routed experts count ``top_k / experts`` of their weights
  (Fedus et al. 2022, "Switch Transformers", Sec. 2; DeepSeek-V3 report, Table 1's "activated
  params").
- FLOPs per token: 6 per active matmul weight (input embedding left out: a lookup; the output
  layer in) plus the attention scores, 12 * layers * heads * head_dim * seq (Narayanan et al.
  2021's 12*s*l*h with the attention's own width), the form torchtitan's ``get_nparams_and_flops``
  and Megatron's MoE accounting use.
- Expert parallel: each MoE layer dispatches every token's hidden state to its ``top_k``
  experts and combines the results back: two all-to-alls forward and two backward, each
  moving tokens x hidden x top_k x capacity_factor x (ep-1)/ep elements per rank (Lepikhin et
  al. 2020, "GShard", Sec. 2.2; Megatron-Core's all-to-all token dispatcher).
- Routing (:func:`rank_load`): balanced, dropless with the busiest expert at ``imbalance`` x
  the mean, or a capacity factor that drops what is over it. Ranks wait for each other at
  every all-to-all, so the busiest rank's expert work, message and activations set the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from meshrun.plan.inputs import Layout, Model, Moe, MoeRouting, Recompute

# Names Hugging Face configs (and common own configs) give the routing, in the order tried.
EXPERTS_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_NAMES = ("num_experts_per_tok", "moe_top_k", "top_k", "experts_per_token")
# The module whose parameters are the routed experts: Hugging Face's ``mlp.experts`` (fused
# 3-D tensors or a ModuleList of MLPs), Mixtral's ``block_sparse_moe.experts``, torchtitan's
# ``moe.experts``. Shared experts are ``shared_expert(s)``: a different name, counted whole.
EXPERT_MODULE = "experts"


@dataclass(frozen=True)
class Routing:
    """Routed experts per MoE layer and how many each token uses, with where it was read."""

    experts: int
    top_k: int
    source: str

    @property
    def active_fraction(self) -> float:
        return self.top_k / self.experts


def _int_field(values: Mapping[str, Any], names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def read_routing(values: Mapping[str, Any], where: str = "config") -> Routing | None:
    """The routing from a config's fields (``num_experts``/``num_local_experts``/
    ``n_routed_experts`` and ``num_experts_per_tok``/``top_k``), or None for a dense model."""
    experts, top_k = _int_field(values, EXPERTS_NAMES), _int_field(values, TOP_K_NAMES)
    if experts is None or top_k is None or experts[1] < 2:
        return None
    source = f"{where}.{experts[0]} = {experts[1]}, {where}.{top_k[0]} = {top_k[1]}"
    return Routing(experts[1], min(top_k[1], experts[1]), source)


# --- a built model, counted (MFU and `meshrun plan --model`) -------------------------------


@dataclass(frozen=True)
class Counted:
    """A built model's parameters split the way FLOPs see them."""

    total: int
    input_embedding: int  # a lookup: no matmul FLOPs (0 when tied to the output layer)
    routed: int  # parameters under modules named ``experts``
    routed_layers: int  # how many such modules (MoE layers)

    def active_matmul(self, routing: Routing | None) -> float:
        """Weights a token multiplies by: all but the input embedding, the routed experts at
        top_k / experts."""
        dense = self.total - self.input_embedding - self.routed
        return dense + self.routed * (routing.active_fraction if routing else 1.0)


def count_module(model: Any) -> Counted:
    """Count ``model``'s parameters once each: the input embedding (unless tied to a head) and
    the routed experts (every parameter under a module whose name ends in ``experts``)."""
    from torch import nn

    total = sum(p.numel() for p in model.parameters())
    uses: dict[int, int] = {}
    for _name, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    emb = max(embeddings, key=lambda m: m.num_embeddings, default=None)
    lookup = 0 if emb is None or uses[id(emb.weight)] > 1 else emb.weight.numel()
    routed, layers, seen = 0, 0, set()
    for name, module in model.named_modules():
        if name.rpartition(".")[2] != EXPERT_MODULE:
            continue
        layers += 1
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                routed += p.numel()
    return Counted(total, lookup, routed, layers)


def attention_width(values: Mapping[str, Any], hidden: int, heads: int) -> int:
    """heads x head dim of the attention scores: ``head_dim`` when the config gives it (Qwen3:
    128 at hidden 2048 / 32 heads), the mean of q/k's and v's dims for multi-head latent
    attention (DeepSeek-V3: (192 + 128) / 2), else hidden."""
    nope, rope, v = (values.get(k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    if all(isinstance(x, int) and x > 0 for x in (nope, rope, v)):
        return heads * (nope + rope + v) // 2  # type: ignore[operator]
    head_dim = values.get("head_dim")
    if isinstance(head_dim, int) and head_dim > 0:
        return heads * head_dim
    return hidden


def flops_per_token(active_matmul: float, layers: int, width: int, seq: int) -> float:
    """Model (training) FLOPs per token: 6 x active matmul weights + 12 x layers x attention
    width x seq (forward 2 + backward 4 per weight; the q.k and scores.v products)."""
    return 6.0 * active_matmul + 12.0 * layers * width * seq


def module_flops(model: Any, config: Any = None) -> tuple[Callable[[int], float], str] | None:
    """Per-token training FLOPs (a function of the sequence length) of a model that declares
    experts: a routing in its config (a Hugging Face config, or a ``config``/``cfg``/``args``
    object or dict on the module) and modules named ``experts`` holding them; with the source
    line MFU prints. None for a model that declares none."""
    from meshrun.plan.inspect_model import inspect_module

    found = inspect_module(model, config)
    routing = read_routing(found.config_values, found.config_source or "config")
    shape = found.shape
    if routing is None or not all(k in shape for k in ("layers", "hidden", "heads")):
        return None
    counted = count_module(model)
    if counted.routed == 0:
        return None
    active = counted.active_matmul(routing)
    layers, wide = (
        shape["layers"],
        attention_width(found.config_values, shape["hidden"], shape["heads"]),
    )

    def per_token(seq: int) -> float:
        return flops_per_token(active, layers, wide, max(seq, 1))

    source = (
        f"{found.class_name}: {active:,.0f} of {counted.total:,} parameters active (top-{routing.top_k} of {routing.experts} experts, {routing.source}; "
        "6 x active + attention)"
    )
    return per_token, source


def _config_int(values: Mapping[str, Any], *names: str) -> int:
    hit = _int_field(values, names)
    return hit[1] if hit else 0


def moe_of_module(model: Any, values: Mapping[str, Any], hidden: int, where: str) -> Moe | None:
    """The planner's :class:`Moe` of a built model: the routing from its config, the routed
    experts' exact count from its ``experts`` modules, one expert's width from the config
    (``moe_intermediate_size``, else ``intermediate_size`` as Mixtral and OLMoE name it) or
    else from that count, the shared experts' from ``shared_expert_intermediate_size`` or
    ``n_shared_experts`` x the expert width. None for a dense model."""
    routing = read_routing(values, where)
    if routing is None:
        return None
    counted = count_module(model)
    if counted.routed == 0:
        return None
    per_expert = counted.routed / (counted.routed_layers * routing.experts)
    ffn = _config_int(values, "moe_intermediate_size", "expert_ffn", "intermediate_size")
    if not ffn or per_expert not in (2 * hidden * ffn, 3 * hidden * ffn):
        ffn = round(per_expert / (3 * hidden))  # a gated expert's width from its weights
    shared = _config_int(values, "shared_expert_intermediate_size") or ffn * _config_int(
        values, "n_shared_experts", "num_shared_experts"
    )
    return Moe(
        routing.experts,
        routing.top_k,
        ffn,
        shared_ffn=shared,
        moe_layers=counted.routed_layers,
        expert_params=counted.routed,
    )


# --- routing: how evenly the router loads the experts ------------------------------------


def dropped_fraction(r: MoeRouting) -> float:
    """Routed tokens a capacity factor drops (0 unless ``r.kind == "capacity"``). The loads
    are taken as spread evenly from 2 - F to F times the mean (F = ``r.imbalance``: the mean 1,
    the busiest F); an expert keeps C x the mean (C = ``r.capacity``), so the part of the
    spread above C is lost: (F - C)^2 / (4 (F - 1)) when 2 - F <= C < F, 1 - C below it."""
    if r.kind != "capacity":
        return 0.0
    f, c = max(r.imbalance, 1.0), r.capacity
    if c >= f:
        return 0.0
    if c <= 2.0 - f:  # even the least loaded expert is over capacity (or F = 1, C < 1)
        return 1.0 - c
    return (f - c) ** 2 / (4.0 * (f - 1.0))


def rank_load(m: Model, lay: Layout) -> float:
    """The busiest rank's routed tokens over balanced routing's mean: it sets the expert
    compute, the all-to-all's largest message and the experts' activations. With ep = 1 every
    rank runs its own tokens through all the experts, so only the drops change it (1 -
    dropped); with ep > 1 a rank runs its experts' tokens: the busiest expert's factor (dropless:
    F; capacity: min(F, C)), an upper bound when a rank holds several experts."""
    if m.moe is None:
        return 1.0
    r = m.moe.routing
    if r.kind == "balanced":
        return 1.0
    if lay.ep == 1:
        return 1.0 - dropped_fraction(r)
    return min(r.imbalance, r.capacity) if r.kind == "capacity" else r.imbalance


def routed_flops(m: Model, batch: int, recompute: Recompute = "none") -> float:
    """The routed experts' hardware FLOPs of an iteration under balanced routing (capacity
    padding and full recomputation's 4/3 included): what :func:`rank_load` scales."""
    if m.moe is None:
        return 0.0
    routed = expert_params(m) * m.moe.top_k / m.moe.experts * m.moe.capacity_factor
    return 6.0 * batch * m.seq * routed * (4.0 / 3.0 if recompute == "full" else 1.0)


def balanced(m: Model) -> Model:
    """``m`` with balanced routing: the other end of a routing's band."""
    from dataclasses import replace

    if m.moe is None or m.moe.routing.kind == "balanced":
        return m
    return replace(m, moe=replace(m.moe, routing=MoeRouting()))


# --- the planner's MoE model ---------------------------------------------------------------


def moe_layer_count(m: Model) -> int:
    if m.moe is None:
        return 0
    return m.moe.moe_layers or m.layers


def expert_params(m: Model) -> float:
    """Routed experts' parameters over all layers (all experts: what memory holds)."""
    if m.moe is None:
        return 0.0
    if m.moe.expert_params:
        return float(m.moe.expert_params)
    mats = 3 if m.gated_mlp else 2
    return float(moe_layer_count(m) * m.moe.experts * mats * m.hidden * m.moe.expert_ffn)


def active_params(m: Model) -> float:
    """Parameters one token uses (embeddings and head included): the total less the routed
    experts' unused (experts - top_k) / experts."""
    if m.moe is None:
        return float(m.total_params())
    return m.total_params() - expert_params(m) * (1.0 - m.moe.top_k / m.moe.experts)


def expert_stage_params(m: Model, lay: Layout) -> float:
    """Routed experts' parameters of one pipeline stage (before ep): its share of the layers."""
    if m.moe is None:
        return 0.0
    return expert_params(m) * math.ceil(m.layers / lay.pp) / m.layers


def width(m: Model) -> int:
    return m.heads * m.head_dim if m.head_dim else m.hidden


def moe_flops_per_iteration(
    m: Model, batch: int, recompute: Recompute = "none", hardware: bool = True
) -> float:
    """FLOPs of an iteration over ``batch`` sequences of an MoE model: 6 per active matmul
    weight per token (blocks + output layer) + the attention scores. ``hardware``: counts the
    capacity factor's padded expert slots and the recomputation (full: the blocks' forward
    again, 4/3; selective: the scores again); else the model FLOPs MFU counts."""
    assert m.moe is not None
    tokens = batch * m.seq
    blocks = m.layers * m.params_per_layer()
    routed = expert_params(m) * m.moe.top_k / m.moe.experts
    active = blocks - expert_params(m) + routed
    scores = 12.0 * m.layers * width(m) * m.seq
    if hardware:
        active += routed * (m.moe.capacity_factor - 1.0)
        scores *= 2 if recompute == "selective" else 1
    block_flops = tokens * (6.0 * active + scores)
    if hardware and recompute == "full":
        block_flops *= 4.0 / 3.0
    return block_flops + 6.0 * tokens * m.hidden * m.vocab


def moe_activation_per_token(m: Model, load: float = 1.0) -> float:
    """Korthikanti et al.'s per-token 16-bit activation bytes / hidden, averaged over the
    layers: a dense layer keeps 18 + (6 or 4)*ffn/h; an MoE layer keeps 18 for attention, norms
    and the MLP's input, plus per routed slot (top_k x capacity factor) the permuted copy of
    the token (2) and the expert's intermediates ((6 or 4)*expert_ffn/h), plus the shared
    experts' ((6 or 4)*shared_ffn/h). ``load``: the rank's routed tokens over the mean
    (:func:`rank_load`)."""
    assert m.moe is not None
    g = 6.0 if m.gated_mlp else 4.0
    h, moe = m.hidden, m.moe
    slots = moe.top_k * moe.capacity_factor * load
    sparse = 18.0 + slots * (2.0 + g * moe.expert_ffn / h) + g * moe.shared_ffn / h
    dense = 18.0 + g * m.ffn_size / h
    n_moe = moe_layer_count(m)
    return (n_moe * sparse + (m.layers - n_moe) * dense) / m.layers


def a2a_bytes_per_layer(m: Model, lay: Layout, elem_bytes: int) -> float:
    """Bytes one rank sends in ONE all-to-all of an MoE layer (dispatch or combine) for one
    micro-batch: its tokens (sequence split over cp, and over tp by sequence parallelism) x
    hidden x top_k x capacity factor, of which (ep-1)/ep leave the rank."""
    if m.moe is None or lay.ep == 1:
        return 0.0
    tokens = lay.micro_batch * m.seq / (lay.cp * lay.tp)
    slots = m.moe.top_k * m.moe.capacity_factor
    return tokens * m.hidden * slots * elem_bytes * (lay.ep - 1) / lay.ep


def a2a_split(
    m: Model, lay: Layout, elem_bytes: int, local: int, dedupe: bool
) -> tuple[float, float]:
    """(bytes over the node's links, bytes over the network) one rank sends in one all-to-all,
    ``local`` of the ep group's ranks on its node. A plain all-to-all sends every routed copy
    to its rank: (ep-local)/ep of them leave the node. DeepEP (``dedupe``; its README's
    "NVLink forwarding", DeepSeek-V3 report Sec. 3.2.2) sends a token once to each other node
    that holds one of its experts, N-1 nodes x (1 - (1-1/N)^slots) of them with balanced
    routing over N nodes, and forwards it there over NVLink."""
    total = a2a_bytes_per_layer(m, lay, elem_bytes)
    if total == 0 or local >= lay.ep:
        return total, 0.0
    assert m.moe is not None
    remote = total * (lay.ep - local) / (lay.ep - 1)
    if not dedupe:
        return total - remote, remote
    nodes, slots = lay.ep // local, m.moe.top_k * m.moe.capacity_factor
    per_copy = total / (slots * (lay.ep - 1) / lay.ep)  # one token's hidden state
    network = per_copy * (nodes - 1) * (1.0 - (1.0 - 1.0 / nodes) ** slots)
    return total, network  # every copy crosses the node's links (forwarded or local)


def ep_stride(lay: Layout) -> int:
    """How far apart an ep group's ranks are: consecutive when it spans the tp ranks (ep a
    multiple of tp: Megatron's EP x ETP=1 layout), else tp apart (within dp_shard x cp)."""
    return 1 if lay.tp > 1 and lay.ep % lay.tp == 0 else lay.tp


def expert_shard(lay: Layout) -> int:
    """Ranks that hold the same experts: the experts' ZeRO and gradient group. With ETP = 1
    every tp rank runs its own tokens through whole experts, so it is dp_shard x cp x tp / ep."""
    return lay.shard * lay.tp // lay.ep


def a2a_calls_per_layer(recompute: Recompute) -> int:
    """Dispatch + combine forward, their transposes backward; full recomputation redoes the
    forward's two."""
    return 6 if recompute == "full" else 4


def moe_problem(m: Model, lay: Layout) -> str | None:
    """Why ``lay.ep`` cannot split this model's experts, or None."""
    if lay.ep == 1:
        return None
    if m.moe is None:
        return (
            f"ep = {lay.ep} needs a mixture-of-experts model (give --experts/--top-k/"
            "--expert-ffn, or a --model that declares experts)"
        )
    if m.moe.experts % lay.ep:
        return f"ep = {lay.ep} does not divide the {m.moe.experts} experts; use a divisor"
    if (lay.shard * lay.tp) % lay.ep or (lay.ep % lay.tp and lay.shard % lay.ep):
        return (
            f"ep = {lay.ep} must divide dp_shard x cp = {lay.shard} or be a multiple of tp = "
            f"{lay.tp} dividing dp_shard x cp x tp = {lay.shard * lay.tp}: expert parallel "
            "borrows its ranks from them (one expert's matmuls are not split by tp)"
        )
    return None


def moe_model(base: Model, moe: Moe, tied: bool = False) -> Model:
    """``base``'s shape with experts, its parameters counted the Hugging Face way (no biases,
    RMSNorms): each layer's attention, an MoE layer's router, routed and shared experts, a
    dense layer's MLP, the token embedding and the output layer (once when ``tied``)."""
    from dataclasses import replace

    h, layers = base.hidden, base.layers
    d = base.head_dim or h // base.heads
    attention = 2 * h * base.heads * d + 2 * h * base.kv * d
    mats = 3 if base.gated_mlp else 2
    n_moe = moe.moe_layers or layers
    sparse = moe.experts * (mats * h * moe.expert_ffn + h) + mats * h * moe.shared_ffn
    dense = mats * h * base.ffn_size
    blocks = layers * (attention + 2 * h) + n_moe * sparse + (layers - n_moe) * dense
    embeddings = base.vocab * h * (1 if tied else 2) + h
    per_layer = blocks // layers
    routed = n_moe * moe.experts * mats * h * moe.expert_ffn
    return replace(
        base,
        moe=replace(moe, expert_params=routed),
        params=per_layer * layers + embeddings,
        layer_params=per_layer,
    )


__all__ = [
    "Counted",
    "Routing",
    "a2a_bytes_per_layer",
    "a2a_split",
    "active_params",
    "attention_width",
    "balanced",
    "count_module",
    "dropped_fraction",
    "ep_stride",
    "expert_params",
    "expert_shard",
    "flops_per_token",
    "module_flops",
    "moe_flops_per_iteration",
    "moe_model",
    "rank_load",
    "read_routing",
    "routed_flops",
]
