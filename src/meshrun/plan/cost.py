"""The cost model: memory, compute and communication of one layout, as pure functions.

Every formula names its source; docs/plan.md derives them and lists the published figures the
unit tests reproduce. Bytes are bytes, times are seconds, bandwidths bytes/s, FLOPs are counts.

- Model states: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", Sec. 3.1 and 5: 2 + 2 + K bytes per parameter (K = 12 for mixed-precision
  Adam), optimizer states sharded from stage 1, gradients from 2, parameters from 3.
- Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Sec. 4 and Table 2: s*b*h*(34 + 5*a*s/h) bytes per layer in 16-bit.
- FLOPs and parameter count: Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", Sec. 5.1 and Appendix.
- Collectives: the nccl-tests bus-bandwidth conventions (ring all-reduce moves 2(n-1)/n of the
  message per GPU, reduce-scatter and all-gather (n-1)/n), plus the ring's start-up cost in the
  alpha-beta (latency-bandwidth) model: alpha per ring step, 2(n-1) steps for an all-reduce,
  n-1 for a reduce-scatter or all-gather (Thakur, Rabenseifner and Gropp 2005, "Optimization of
  Collective Communication Operations in MPICH", Sec. 2 and 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from meshrun.plan.errors import PlanError

Precision = Literal["bf16", "fp16", "fp32"]
Optimizer = Literal["adam", "adamw", "sgd"]
Recompute = Literal["none", "selective", "full"]
Schedule = Literal["1f1b", "gpipe", "interleaved"]

GB = 1e9


# --- inputs --------------------------------------------------------------------------------


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
    vpp: int = 1  # virtual stages per rank (interleaved schedule)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp


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


def flops_per_iteration(m: Model, batch: int, recompute: Recompute = "none") -> float:
    """Hardware FLOPs of one iteration over ``batch`` sequences.

    72*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) without recomputation, 96*... with full
    recomputation (Narayanan et al. 2021, Eq. 3); selective recomputation redoes only the
    attention scores: 72*B*s*l*h^2*(1 + s/(3h) + V/(16*l*h)) (Korthikanti et al. 2022, Sec. 6).
    For other shapes the h^2 term is 6 FLOPs per block weight per token (q/kv/out/MLP).
    """
    b, s, h, l_ = batch, m.seq, m.hidden, m.layers
    linear = 6.0 * b * s * l_ * (m.params_per_layer() - _small_terms(m))
    attention = 12.0 * b * s * s * l_ * h * (2 if recompute == "selective" else 1)
    factor = 4.0 / 3.0 if recompute == "full" else 1.0
    return factor * (linear + attention) + logits_flops(m, batch, recompute)


def logits_flops(m: Model, batch: int, recompute: Recompute = "none") -> float:
    """The output layer's part of :func:`flops_per_iteration`: the V/(16*l*h) term."""
    factor = 4.0 / 3.0 if recompute == "full" else 1.0
    return factor * 4.5 * batch * m.seq * m.hidden * m.vocab


def model_flops_per_iteration(m: Model, batch: int) -> float:
    """Model FLOPs (no recomputation counted): the numerator of MFU."""
    return flops_per_iteration(m, batch, "none")


def _small_terms(m: Model) -> int:
    # Biases and norms cost no matmul FLOPs: leaving them out makes the shape formula give
    # exactly 72*B*s*l*h^2 for the standard block (12h^2 weights).
    h, f = m.hidden, m.ffn_size
    kv_dim = h * m.kv // m.heads
    return (h + 2 * kv_dim) + h + f + h + 4 * h


def training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """End-to-end training time 8*T*P/(n*X) (Narayanan et al. 2021, Sec. 5.1), in days."""
    return 8.0 * tokens * params / (gpus * flops_per_gpu) / 86400.0


# --- memory (ZeRO paper accounting, Korthikanti activations) -------------------------------


def state_bytes_per_param(t: Training) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter: 2 + 2 + K in mixed precision.

    K = 12 for Adam (fp32 master weights, momentum, variance), 8 for SGD with momentum (master
    weights, momentum); in fp32, 4 + 4 + 8 (Adam) or 4 + 4 + 4 (SGD).
    """
    adam = t.optimizer in ("adam", "adamw")
    if t.precision == "fp32":
        return 4, 4, 8 if adam else 4
    return 2, 2, 12 if adam else 8


def model_state_bytes(params: float, t: Training, zero: int, shard: int) -> tuple[float, ...]:
    """(params, grads, optimizer) bytes on one GPU for ``params`` parameters, ZeRO stage
    ``zero`` sharded over ``shard`` ranks (Rajbhandari et al. 2020, Sec. 5.1, Fig. 1)."""
    p, g, k = state_bytes_per_param(t)
    return (
        p * params / (shard if zero >= 3 else 1),
        g * params / (shard if zero >= 2 else 1),
        k * params / (shard if zero >= 1 else 1),
    )


def activation_bytes_per_layer(
    m: Model, micro_batch: int, tp: int, recompute: Recompute, fused: bool = False
) -> float:
    """Korthikanti et al. 2022, Table 2, with tensor and sequence parallelism over ``tp``:
    s*b*h*(34 + 5*a*s/h)/t, selective recomputation s*b*h*34/t, full recomputation 2*s*b*h/t.

    The 34 is 18 + 4*ffn/h (attention 11, LayerNorms 4, MLP 3 + 4*ffn/h), so a different MLP
    width changes it (a gated MLP keeps three ffn-wide tensors: 6*ffn/h); GQA's smaller K/V are not credited (an overestimate). ``fused``
    attention stores no scores, like selective recomputation (which it effectively is)."""
    s, b, h = m.seq, micro_batch, m.hidden
    if recompute == "full":
        return 2.0 * s * b * h / tp
    per_token = 18.0 + (6.0 if m.gated_mlp else 4.0) * m.ffn_size / h
    if recompute == "none" and not fused:
        per_token += 5.0 * m.heads * s / h
    return s * b * h * per_token / tp


def inflight_layers(m: Model, lay: Layout, microbatches: int) -> float:
    """Layer-activations the first pipeline stage holds at its peak.

    1F1B keeps min(p, m) microbatches of l/p layers (= l when m >= p), times
    1 + (p-1)/(p*v) for the interleaved schedule (Korthikanti et al. 2022, Sec. 4.2.3);
    GPipe keeps all m microbatches."""
    per_stage = m.layers / lay.pp
    if lay.pp == 1:
        return float(m.layers)
    if lay.schedule == "gpipe":
        return per_stage * microbatches
    held = per_stage * min(lay.pp, microbatches)
    if lay.schedule == "interleaved":
        held *= 1.0 + (lay.pp - 1) / (lay.pp * lay.vpp)
    return held


def activation_bytes(m: Model, lay: Layout, t: Training, microbatches: int) -> float:
    """Activations on one GPU: stored layers, plus one layer's full working set while it is
    recomputed (full recomputation), plus the fp32 logits of the loss, 4*s*b*V/t."""
    if not m.has_shape:
        return 0.0
    b, tp, ac, fused = lay.micro_batch, lay.tp, lay.activation_checkpointing, t.fused_attention
    per_layer = activation_bytes_per_layer(m, b, tp, ac, fused)
    stored = inflight_layers(m, lay, microbatches) * per_layer
    if ac == "full":
        stored += activation_bytes_per_layer(m, b, tp, "none", fused)
    stored += 4.0 * m.seq * b * m.vocab / (tp if t.tp_embeddings else 1)
    # The published constants count 16-bit tensors; fp32 training doubles them.
    return stored * (2.0 if t.precision == "fp32" else 1.0)


@dataclass
class Memory:
    """Bytes per GPU (the most loaded one: the first pipeline stage)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def as_gb(self) -> dict[str, float]:
        fields = ("params", "grads", "optimizer", "activations", "buffers")
        out = {k: round(getattr(self, k) / GB, 3) for k in fields}
        out["total"] = round(self.total / GB, 3)
        return out


def stage_params(m: Model, lay: Layout, t: Training | None = None) -> float:
    """Parameters on one GPU before data-parallel sharding: a pipeline stage's blocks divided by
    tensor parallelism, plus the embeddings and output layer (counted on the first stage, the
    most loaded), divided by it only when the TP plan splits them (``tp_embeddings``)."""
    if not m.has_shape:
        return m.total_params() / (lay.tp * lay.pp)
    blocks = math.ceil(m.layers / lay.pp) * m.params_per_layer()
    embeddings = m.total_params() - m.layers * m.params_per_layer()
    split = lay.tp if t is not None and t.tp_embeddings else 1
    return blocks / lay.tp + embeddings / split


def memory(m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int) -> Memory:
    """The per-GPU memory breakdown of a layout (see docs/plan.md)."""
    local = stage_params(m, lay, t)
    p, g, o = model_state_bytes(local, t, lay.zero, lay.dp_shard)
    act = activation_bytes(m, lay, t, microbatches)
    gather = _gather_buffer(m, lay, t)
    buffers = c.allowance_bytes + gather + c.fragmentation * (p + g + o + act + gather)
    return Memory(p, g, o, act, buffers)


def _gather_buffer(m: Model, lay: Layout, t: Training) -> float:
    # ZeRO-3/FSDP gathers one block's full parameters and prefetches the next: two blocks.
    if lay.zero < 3 or not m.has_shape:
        return 0.0
    return 2.0 * m.params_per_layer() / lay.tp * state_bytes_per_param(t)[0]


# --- communication (nccl-tests conventions) ------------------------------------------------


def all_reduce_time(n: int, nbytes: float, bw: float, latency: float = 0.0) -> float:
    """Ring all-reduce: 2(n-1) steps of ``latency`` each, and each GPU moves 2(n-1)/n of the
    message over its link (``bw``: the all-reduce's bus bandwidth)."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) * (latency + nbytes / (n * bw))


def gather_time(n: int, nbytes: float, bw: float, latency: float = 0.0) -> float:
    """Reduce-scatter or all-gather of a ``nbytes`` (full-size) message: n-1 steps, (n-1)/n of
    the bytes (``bw``: that op's bus bandwidth)."""
    return 0.0 if n <= 1 else (n - 1) * (latency + nbytes / (n * bw))


@dataclass(frozen=True)
class Link:
    """What one collective group reaches: the all-reduce bus bandwidth (bytes/s), the
    all-gather/reduce-scatter ones, and the latency per ring step (s)."""

    size: int
    bw: float
    latency: float
    ag_bw: float
    rs_bw: float

    def all_reduce(self, nbytes: float, calls: float = 1.0) -> float:
        """``calls`` all-reduces moving ``nbytes`` in all (split evenly between them)."""
        if calls <= 0:
            return 0.0
        return calls * all_reduce_time(self.size, nbytes / calls, self.bw, self.latency)

    def all_gather(self, nbytes: float, calls: float = 1.0) -> float:
        if calls <= 0:
            return 0.0
        return calls * gather_time(self.size, nbytes / calls, self.ag_bw, self.latency)

    def reduce_scatter(self, nbytes: float, calls: float = 1.0) -> float:
        if calls <= 0:
            return 0.0
        return calls * gather_time(self.size, nbytes / calls, self.rs_bw, self.latency)


def group_link(c: Cluster, size: int, stride: int) -> Link:
    """The link a group really crosses: ranks are placed tp-fastest on consecutive GPUs, so a
    group of ``size`` ranks ``stride`` apart stays inside a node iff size*stride <= GPUs/node."""
    inside = size * stride <= c.gpus_per_node
    bw = (c.intra_bw if inside else c.inter_bw) * c.comm_efficiency
    latency = c.intra_latency if inside else c.inter_latency
    return Link(size, bw, latency, bw * c.all_gather_ratio, bw * c.reduce_scatter_ratio)


def group_bandwidth(c: Cluster, size: int, stride: int) -> float:
    """The all-reduce bus bandwidth of :func:`group_link`."""
    return group_link(c, size, stride).bw


@dataclass
class StepTime:
    """Seconds per optimizer step, split the way a profiler would show it."""

    compute: float
    dp_comm: float  # total data-parallel/ZeRO traffic time
    dp_exposed: float  # the part not hidden behind compute
    tp_comm: float
    pp_comm: float
    bubble: float
    optimizer: float = 0.0  # the update: memory-bound, not hidden
    tp_overhead: float = 0.0  # DTensor's dispatch and waiting per TP layer (Cluster's)
    fsdp_overhead: float = 0.0  # FSDP2's hooks and waiting per unit collective (Cluster's)

    @property
    def exposed_comm(self) -> float:
        return self.dp_exposed + self.tp_comm + self.pp_comm

    @property
    def total(self) -> float:
        return (self.compute + self.exposed_comm + self.bubble + self.optimizer
                + self.tp_overhead + self.fsdp_overhead)  # fmt: skip


def step_time(m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int) -> StepTime:
    """Step time of a layout: compute at the achievable rate, exposed communication, bubble."""
    hw_flops = flops_per_iteration(m, t.global_batch, lay.activation_checkpointing)
    if not t.tp_embeddings:  # every tp rank computes the whole output layer
        hw_flops += (lay.tp - 1) * logits_flops(m, t.global_batch, lay.activation_checkpointing)
    compute = hw_flops / (c.world * c.peak_flops * c.compute_efficiency)
    dp = _dp_comm(m, lay, t, c, microbatches)
    window = _hiding_window(lay, compute, microbatches)
    dp_exposed = max(0.0, dp - c.overlap * window)
    bubble = compute * (lay.pp - 1) / (lay.vpp * microbatches)
    return StepTime(compute, dp, dp_exposed, _tp_comm(m, lay, t, c, microbatches),
                    _pp_comm(m, lay, t, c, microbatches), bubble,
                    optimizer_time(m, lay, t, c), tp_overhead(m, lay, c, microbatches),
                    fsdp_overhead(m, lay, c, microbatches))  # fmt: skip


def tp_overhead(m: Model, lay: Layout, c: Cluster, microbatches: int) -> float:
    """``tp_layer_overhead`` (DTensor's dispatch and the waiting at its all-reduces) per
    tensor-parallel linear layer of the GPU's blocks, per micro-batch (forward + backward); 0
    without TP or a shape."""
    if lay.tp == 1 or not m.has_shape:
        return 0.0
    blocks = math.ceil(m.layers / lay.pp)
    return c.tp_layer_overhead * m.tp_linears() * blocks * microbatches


def fsdp_collectives(m: Model, lay: Layout, microbatches: int) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) FSDP2 issues per optimizer step on a GPU: every unit
    gathers in every micro-batch's forward, ZeRO-3 regathers the blocks in its backward (the
    root stays gathered), and every unit reduce-scatters once per step (gradient sync only on
    the boundary micro-batch); (0, 0) below ZeRO-2."""
    if lay.zero < 2:
        return 0, 0
    units = fsdp_units(m, lay)
    return microbatches * (units + (units - 1 if lay.zero >= 3 else 0)), units


def fsdp_overhead(m: Model, lay: Layout, c: Cluster, microbatches: int) -> float:
    """``fsdp_unit_overhead`` per collective FSDP2 issues (:func:`fsdp_collectives`); 0
    below ZeRO-2 or with one shard (FSDP2 then issues no collective)."""
    if lay.dp_shard == 1:
        return 0.0
    return c.fsdp_unit_overhead * sum(fsdp_collectives(m, lay, microbatches))


def optimizer_time(m: Model, lay: Layout, t: Training, c: Cluster) -> float:
    """The optimizer step streams its shard's states through memory: Adam reads parameter,
    gradient and both moments and writes three of them back (28 bytes per parameter in fp32,
    the same with mixed precision's master weights), SGD with momentum 20; at the calibrated
    ``optimizer_bw`` (which includes the per-tensor launch costs), else the memory bandwidth."""
    bw = c.optimizer_bw or c.mem_bw
    if bw <= 0:
        return 0.0
    local = stage_params(m, lay, t) / (lay.dp_shard if lay.zero >= 1 else 1)
    per_param = 28.0 if t.optimizer in ("adam", "adamw") else 20.0
    return local * per_param / bw


def _hiding_window(lay: Layout, compute: float, microbatches: int) -> float:
    # DDP and ZeRO-1/2 reduce gradients during the last micro-batch's backward (2/3 of its
    # compute); ZeRO-3 gathers and reduce-scatters during every micro-batch.
    return compute if lay.zero >= 3 else compute / microbatches * 2.0 / 3.0


# DDP's bucketing (torch defaults; meshrun's parallel.bucket_cap_mb): the gradients computed
# last go into a small first bucket so that the first all-reduce starts early.
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20


def ddp_buckets(grad_bytes: float) -> int:
    """All-reduce calls DDP issues for ``grad_bytes`` of gradients."""
    return 1 + math.ceil(max(0.0, grad_bytes - DDP_FIRST_BUCKET_BYTES) / DDP_BUCKET_BYTES)


def fsdp_units(m: Model, lay: Layout) -> int:
    """FSDP2 units on a GPU: meshrun shards each block, then the root (embeddings, head); each
    unit is its own all-gather and reduce-scatter."""
    return math.ceil(m.layers / lay.pp) + 1 if m.has_shape else 1


def _dp_comm(m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int) -> float:
    grad_bytes = stage_params(m, lay, t) * state_bytes_per_param(t)[1]
    dp_link = group_link(c, lay.dp, lay.tp)
    if lay.zero <= 1:  # DDP: bucketed all-reduces over the whole data-parallel group
        ddp = dp_link.all_reduce(grad_bytes, ddp_buckets(grad_bytes))
        # ZeRO-1 (ZeroRedundancyOptimizer): then every rank's updated shard is gathered.
        return ddp + (dp_link.all_gather(grad_bytes) if lay.zero == 1 else 0.0)
    return _fsdp_comm(m, lay, t, c, microbatches, grad_bytes)


def _fsdp_comm(
    m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int, total: float
) -> float:
    """FSDP2, one collective per unit: all-gather in every micro-batch's forward (ZeRO-3: again
    in its backward, for the blocks; the root stays gathered), one reduce-scatter per step
    (gradient sync only on the boundary micro-batch), across replicas (HSDP) an all-reduce of
    the shard; plus FSDP2's copy-in/copy-out of each gathered and reduced buffer."""
    calls, units = fsdp_collectives(m, lay, microbatches)
    shard = group_link(c, lay.dp_shard, lay.tp)
    blocks = _block_params(m, lay) * state_bytes_per_param(t)[1]  # the root is not regathered
    gathered = microbatches * (total + (blocks if lay.zero >= 3 else 0.0))
    time = shard.all_gather(gathered, calls) + shard.reduce_scatter(total, units)
    replicas = group_link(c, lay.dp_replicate, lay.tp * lay.dp_shard)
    time += replicas.all_reduce(total / lay.dp_shard, units)
    if c.mem_bw > 0:  # copy-in (shard or whole) and copy-out (whole or shard), read + write
        time += 2.0 * (1.0 + 1.0 / lay.dp_shard) * (gathered + total) / c.mem_bw
    return time


def _block_params(m: Model, lay: Layout) -> float:
    if not m.has_shape:
        return stage_params(m, lay)
    return math.ceil(m.layers / lay.pp) * m.params_per_layer() / lay.tp


def _tp_comm(m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int) -> float:
    """Megatron TP: per layer 2 all-reduces forward and 2 backward (with sequence parallel each
    is an all-gather + a reduce-scatter: the same bytes and ring steps), 6 with full
    recomputation; over the intra-node link; not hidden. Separate q/k/v layers all-reduce
    their input gradients one by one: 2 more all-reduces of the same size in backward."""
    if lay.tp == 1 or not m.has_shape:
        return 0.0
    act = m.seq * lay.micro_batch * m.hidden * _act_elem_bytes(t)
    link = group_link(c, lay.tp, 1)
    if t.sequence_parallel:
        one = link.all_gather(act) + link.reduce_scatter(act)
    else:
        one = link.all_reduce(act)
    calls = 6 if lay.activation_checkpointing == "full" else 4
    extra = 2 * link.all_reduce(act) if m.separate_qkv else 0.0
    return (calls * one + extra) * math.ceil(m.layers / lay.pp) * microbatches


def _pp_comm(m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int) -> float:
    """Point-to-point: each micro-batch sends its activation forward and its gradient back at
    every stage boundary it crosses (v times per rank when interleaved); not hidden."""
    if lay.pp == 1 or not m.has_shape:
        return 0.0
    act = m.seq * lay.micro_batch * m.hidden * _act_elem_bytes(t) / lay.tp
    link = group_link(c, 2, lay.tp * lay.dp)  # neighbouring stages are dp*tp ranks apart
    return 2.0 * (link.latency + act / link.bw) * lay.vpp * microbatches


def _act_elem_bytes(t: Training) -> int:
    return 4 if t.precision == "fp32" else 2


# --- one layout, evaluated -----------------------------------------------------------------


@dataclass
class Estimate:
    """Everything the planner says about one layout."""

    layout: Layout
    microbatches: int  # gradient-accumulation steps = pipeline micro-batches
    memory: Memory
    time: StepTime | None  # None for a bare parameter count
    fits: bool
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    notes: list[str] = field(default_factory=list)


def evaluate(m: Model, lay: Layout, t: Training, c: Cluster) -> Estimate:
    """Memory, step time, throughput and MFU of one (already validated) layout."""
    microbatches = t.global_batch // (lay.micro_batch * lay.dp)
    mem = memory(m, lay, t, c, microbatches)
    fits = mem.total <= c.memory_bytes
    if not m.has_shape:
        return Estimate(lay, microbatches, mem, None, fits)
    st = step_time(m, lay, t, c, microbatches)
    tokens = t.global_batch * m.seq / st.total
    mfu = model_flops_per_iteration(m, t.global_batch) / (st.total * c.world * c.peak_flops)
    return Estimate(lay, microbatches, mem, st, fits, tokens, mfu)
