"""The cost model's inputs (pure data): a model's shape, the training settings, the cluster's
rates and one layout, with the GPT parameter count (Narayanan et al. 2021, Sec. 5.1 and
Appendix) the shape's defaults come from. plan/cost.py and plan/memory.py read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from meshrun.plan.errors import PlanError

Precision = Literal["bf16", "fp16", "fp32"]
Optimizer = Literal["adam", "adamw", "sgd"]
Recompute = Literal["none", "selective", "full"]
Schedule = Literal["1f1b", "gpipe", "interleaved", "zb1p", "zbv", "dualpipev"]
CpAttention = Literal["ring", "ulysses"]
EpDispatch = Literal["all_to_all", "deepep"]
RoutingKind = Literal["balanced", "dropless", "capacity"]

GB = 1e9


# --- inputs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeRouting:
    """How the router spreads tokens over the experts (plan/moe.py's ``rank_load``):
    ``balanced`` (every expert gets the mean), ``dropless`` (every token runs; the busiest
    expert gets ``imbalance`` x the mean) or ``capacity`` (an expert keeps at most ``capacity``
    x the mean and drops the rest). ``imbalance``: the busiest expert's load over the mean
    (DeepSeek's MaxVio + 1), measured or given."""

    kind: RoutingKind = "balanced"
    imbalance: float = 1.0
    capacity: float = 0.0  # capacity factor with drops (``kind == "capacity"`` only)


@dataclass(frozen=True)
class Moe:
    """A mixture-of-experts model's routing (plan/moe.py reads it, docs/plan.md derives it):
    ``experts`` routed experts per MoE layer of which each token uses ``top_k``, each an MLP of
    width ``expert_ffn``; shared experts (always used) of ``shared_ffn`` in all; ``moe_layers``
    of the model's layers hold experts (0: all; the rest are dense MLPs of ``Model.ffn``).
    ``expert_params``: the routed experts' parameters over all layers (0: from the shape)."""

    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0
    moe_layers: int = 0
    capacity_factor: float = 1.0  # slots per routed token; 1.0 = dropless, no padding
    expert_params: int = 0
    routing: MoeRouting = MoeRouting()


@dataclass(frozen=True)
class Model:
    """A transformer's shape, or a bare parameter count (``layers == 0``: model states only).

    ``params`` and ``layer_params`` override the GPT formulas when the exact counts are known
    (a model inspected on the meta device).
    """

    layers: int = 0
    hidden: int = 0
    heads: int = 0
    vocab: int = 0
    seq: int = 0
    kv_heads: int = 0  # 0 = heads (multi-head attention)
    ffn: int = 0  # 0 = 4 * hidden
    gated_mlp: bool = False  # SwiGLU/GeGLU: three h x ffn matrices instead of two
    params: int = 0  # exact total, 0 = gpt_params()
    layer_params: int = 0  # exact per-layer count, 0 = from the shape
    # q, k and v as three nn.Linear layers (meshrun's demo GPT, Hugging Face's q_proj/k_proj/
    # v_proj) rather than one fused qkv (Megatron): under TP each column-parallel layer
    # all-reduces its own input gradient, so the attention's backward takes 3 all-reduces, not 1.
    separate_qkv: bool = False
    moe: Moe | None = None  # routed experts (plan/moe.py); None: a dense model
    head_dim: int = 0  # attention width per head, 0 = hidden / heads (MLA: mean of qk and v)

    @property
    def has_shape(self) -> bool:
        return self.layers > 0

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    def total_params(self) -> int:
        return self.params or gpt_params(self)

    def params_per_layer(self) -> int:
        return self.layer_params or _layer_params(self)

    def tp_linears(self) -> int:
        """Tensor-parallel linear layers per block: q, k, v (or one fused qkv) and the
        attention output; the MLP's up (and gate) and down projections."""
        return (4 if self.separate_qkv else 2) + (3 if self.gated_mlp else 2)


@dataclass(frozen=True)
class Training:
    """How the model is trained: batch, precision, optimizer."""

    global_batch: int = 512  # samples (sequences) per optimizer step
    precision: Precision = "bf16"
    optimizer: Optimizer = "adamw"
    # Fused attention (PyTorch SDPA flash / memory-efficient kernels, FlashAttention) keeps no
    # s x s score matrices: the 5*a*s/h term of the activations disappears.
    fused_attention: bool = True
    # meshrun's default tensor-parallel plan splits the blocks' matmuls only: embeddings, the
    # output layer and the final norm stay whole on every tp rank (Megatron splits the
    # vocabulary too: set this to True for such a plan).
    tp_embeddings: bool = False
    # Megatron sequence parallelism: TP's all-reduces become all-gathers + reduce-scatters
    # (same bytes and ring steps, the rates of those ops); off = plain all-reduces.
    sequence_parallel: bool = True
    # Context parallel's attention (plan/long_seq.py): ring attention passes K/V around the cp
    # ranks (torch's context_parallel, Megatron), Ulysses all-to-alls heads for sequence.
    cp_attention: CpAttention = "ring"
    # Expert parallel's token dispatcher: a plain all-to-all (torch, Megatron's alltoall), or
    # DeepEP's, which sends a token once per remote node and forwards it over NVLink.
    ep_dispatch: EpDispatch = "all_to_all"


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical GPUs. Rates are what is really reached (peak x efficiency)."""

    nodes: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    intra_bw: float
    inter_bw: float
    compute_efficiency: float = 0.5  # achievable fraction of peak for the whole step's math
    comm_efficiency: float = 0.7  # achievable fraction of the nominal link bandwidth
    overlap: float = 0.8  # fraction of the hiding window that DP communication can use
    mem_bw: float = 0.0  # device memory bandwidth (copies, the optimizer); 0 = not modelled
    # alpha of the alpha-beta model: seconds per ring step of a collective (start-up and
    # synchronisation), inside a node and between nodes; 0 = not modelled.
    intra_latency: float = 0.0
    inter_latency: float = 0.0
    # All-gather / reduce-scatter bus bandwidth as a multiple of the all-reduce's on the same
    # link: 1 for NCCL's rings; a backend whose ops differ (Gloo) is calibrated by bench.
    all_gather_ratio: float = 1.0
    reduce_scatter_ratio: float = 1.0
    optimizer_bw: float = 0.0  # bytes/s the optimizer step streams its states at; 0 = mem_bw
    # Time per tensor-parallel linear layer and micro-batch (forward + backward) beyond its
    # math and its all-reduce: DTensor's Python dispatch (from_local/to_local, redistribute,
    # the autograd wrappers) and the waiting at the all-reduce for a partner that drifted.
    # On a GPU the host runs ahead of the kernels and hides it (0, the default); on a CPU it
    # takes the same cores: `meshrun bench comm` measures it (bench_tp).
    tp_layer_overhead: float = 0.0
    # Time per collective FSDP2 issues (a unit's all-gather in forward, again in backward under
    # ZeRO-3, its reduce-scatter) beyond its bytes and ring steps and the modelled copies: the
    # unit's pre/post hooks, DTensor bookkeeping, and on a CPU the wait for the slower rank at
    # each blocking collective. A GPU's host runs ahead and its streams hide it (0, the
    # default); on a CPU `meshrun bench comm` measures it (bench_fsdp).
    fsdp_unit_overhead: float = 0.0
    allowance_bytes: float = 1.0 * GB  # CUDA context, NCCL buffers, allocator reserve
    fragmentation: float = 0.05  # extra fraction of everything else

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Layout:
    """One parallel layout: the ``[parallel]`` keys plus micro-batch and recomputation."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    micro_batch: int = 1
    activation_checkpointing: Recompute = "none"
    schedule: Schedule = "1f1b"
    vpp: int = 1  # stages per rank (interleaved, zb1p; 2 for zbv and dualpipev)
    # Expert parallel: the routed experts split over ep ranks borrowed from dp_shard x cp (and
    # tp, whose ranks run whole experts on their own tokens): it does not multiply the world.
    # Context parallel: the sequence split over cp ranks, a mesh dimension between dp_shard and tp.
    ep: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Ranks the non-expert states are sharded (ZeRO) and reduced over: dp_shard x cp
        (context-parallel ranks hold the same parameters and see different tokens)."""
        return self.dp_shard * self.cp

    @property
    def size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp


# --- parameter count and FLOPs (Narayanan et al. 2021) -------------------------------------


def _layer_params(m: Model) -> int:
    """Weights and biases of one GPT block: attention (q, kv, out), MLP, two LayerNorms."""
    h, f = m.hidden, m.ffn_size
    kv_dim = h * m.kv // m.heads
    attention = h * (h + 2 * kv_dim) + (h + 2 * kv_dim) + h * h + h
    mlp = (3 if m.gated_mlp else 2) * h * f + f + h
    return attention + mlp + 4 * h


def gpt_params(m: Model) -> int:
    """12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)) for the standard shape (Narayanan et al. 2021,
    Sec. 5.1): blocks plus token and position embeddings (output layer tied, final norm left out
    as in the paper)."""
    if not m.has_shape:
        raise PlanError("the parameter count needs a shape (--layers ...) or --params")
    return m.layers * _layer_params(m) + (m.vocab + m.seq) * m.hidden
