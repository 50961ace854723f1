"""The cost model: memory, compute and communication of one layout, as pure functions (the
inputs in plan/inputs.py, the memory side in plan/memory.py).

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
- The pipeline bubble per schedule: plan/bubble.py (Megatron-LM, Zero Bubble, DeepSeek-V3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The inputs travel with the model: callers import them from here (``as`` marks the re-export).
from meshrun.plan.bubble import bubble_fraction, split_for
from meshrun.plan.inputs import GB as GB
from meshrun.plan.inputs import Cluster, Layout, Model, Recompute, Training
from meshrun.plan.inputs import gpt_params as gpt_params
from meshrun.plan.long_seq import attention_flops_per_layer, ring_kv_bytes, ulysses_bytes
from meshrun.plan.memory import Memory, memory, rank_params, state_bytes_per_param
from meshrun.plan.memory import stage_params as stage_params
from meshrun.plan.moe import (
    a2a_calls_per_layer,
    a2a_split,
    balanced,
    dropped_fraction,
    ep_stride,
    expert_shard,
    expert_stage_params,
    moe_flops_per_iteration,
    moe_layer_count,
    rank_load,
    routed_flops,
)


def flops_per_iteration(m: Model, batch: int, recompute: Recompute = "none") -> float:
    """Hardware FLOPs of one iteration over ``batch`` sequences.

    72*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) without recomputation, 96*... with full
    recomputation (Narayanan et al. 2021, Eq. 3); selective recomputation redoes only the
    attention scores: 72*B*s*l*h^2*(1 + s/(3h) + V/(16*l*h)) (Korthikanti et al. 2022, Sec. 6).
    For other shapes the h^2 term is 6 FLOPs per block weight per token (q/kv/out/MLP); a
    mixture of experts counts its active weights (plan/moe.py).
    """
    if m.moe is not None:
        return moe_flops_per_iteration(m, batch, recompute)
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
    if m.moe is not None:  # active parameters, no capacity padding
        return moe_flops_per_iteration(m, batch, "none", hardware=False)
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


def all_to_all_time(c: Cluster, size: int, stride: int, nbytes: float) -> float:
    """An all-to-all in which a rank sends ``nbytes`` to the other ``size``-1 ranks of a group
    ``stride`` apart: the part to ranks on its own node at the intra-node bandwidth, the rest
    at the inter-node one, both at once; size-1 messages of latency."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    local = max(1, min(size, c.gpus_per_node // stride))  # group members on a rank's node
    remote = (size - local) / (size - 1)
    inside = nbytes * (1 - remote) / (c.intra_bw * c.comm_efficiency)
    outside = nbytes * remote / (c.inter_bw * c.comm_efficiency) if remote else 0.0
    latency = c.inter_latency if remote else c.intra_latency
    return (size - 1) * latency + max(inside, outside)


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
    ep_comm: float = 0.0  # expert parallel's all-to-alls (dispatch, combine), not hidden
    cp_comm: float = 0.0  # context parallel's exposed K/V passes or all-to-alls

    @property
    def exposed_comm(self) -> float:
        return self.dp_exposed + self.tp_comm + self.pp_comm + self.ep_comm + self.cp_comm

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.exposed_comm
            + self.bubble
            + self.optimizer
            + self.tp_overhead
            + self.fsdp_overhead
        )


def step_time(m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int) -> StepTime:
    """Step time of a layout: compute at the achievable rate, exposed communication, bubble."""
    hw_flops = flops_per_iteration(m, t.global_batch, lay.activation_checkpointing)
    # Routing: the busiest rank's experts run rank_load x the mean and every rank waits for it.
    load = rank_load(m, lay)
    hw_flops += (load - 1.0) * routed_flops(m, t.global_batch, lay.activation_checkpointing)
    if not t.tp_embeddings:  # every tp rank computes the whole output layer
        hw_flops += (lay.tp - 1) * logits_flops(m, t.global_batch, lay.activation_checkpointing)
    compute = hw_flops / (c.world * c.peak_flops * c.compute_efficiency)
    dp = _dp_comm(m, lay, t, c, microbatches)
    window = _hiding_window(lay, compute, microbatches)
    dp_exposed = max(0.0, dp - c.overlap * window)
    split = split_for(lay.activation_checkpointing)
    bubble = compute * bubble_fraction(lay.schedule, lay.pp, lay.vpp, microbatches, split)
    return StepTime(
        compute,
        dp,
        dp_exposed,
        _tp_comm(m, lay, t, c, microbatches),
        _pp_comm(m, lay, t, c, microbatches),
        bubble,
        optimizer_time(m, lay, t, c),
        tp_overhead(m, lay, c, microbatches),
        fsdp_overhead(m, lay, c, microbatches),
        ep_comm(m, lay, t, c, microbatches),
        cp_comm(m, lay, t, c, microbatches),
    )


def ep_comm(m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int) -> float:
    """Expert parallel: per MoE layer of the stage and micro-batch, dispatch + combine forward
    and their transposes backward (plan/moe.py), over the ep group: the bytes to ranks on the
    node at the intra-node bandwidth, those leaving it at the inter-node one, at once (DeepEP:
    once per node, :func:`a2a_split`); not hidden (each waits for the router before it and the
    experts wait for it). The busiest rank's message (:func:`rank_load` x the mean) sets it."""
    if lay.ep == 1:
        return 0.0
    local = max(1, min(lay.ep, c.gpus_per_node // ep_stride(lay)))  # ep ranks on a node
    deepep = t.ep_dispatch == "deepep"
    inside, outside = a2a_split(m, lay, _act_elem_bytes(t), local, deepep)
    inside, outside = inside * rank_load(m, lay), outside * rank_load(m, lay)
    one = max(inside / (c.intra_bw * c.comm_efficiency), outside / (c.inter_bw * c.comm_efficiency))
    one += (lay.ep - 1) * (c.inter_latency if outside else c.intra_latency)
    layers = math.ceil(moe_layer_count(m) / lay.pp)
    return one * a2a_calls_per_layer(lay.activation_checkpointing) * layers * microbatches


def cp_comm(m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int) -> float:
    """Context parallel, per layer of the stage and micro-batch (plan/long_seq.py): ring
    attention's K/V sends to the next rank, less the attention math they overlap with; or
    Ulysses' all-to-alls, not hidden."""
    if lay.cp == 1 or not m.has_shape:
        return 0.0
    layers = math.ceil(m.layers / lay.pp) * microbatches
    elem = _act_elem_bytes(t)
    if t.cp_attention == "ulysses":
        nbytes, calls = ulysses_bytes(m, lay, elem)
        return layers * calls * all_to_all_time(c, lay.cp, lay.tp, nbytes / calls)
    chunk, sends = ring_kv_bytes(m, lay, elem)
    link = group_link(c, lay.cp, lay.tp)
    comm = sends * (link.latency + chunk / link.bw)
    math_time = attention_flops_per_layer(m, lay) / (c.peak_flops * c.compute_efficiency)
    return layers * max(0.0, comm - math_time)


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
    if lay.shard == 1:
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
    dense, experts = rank_params(m, lay, t)
    local = dense / lay.shard + experts / expert_shard(lay) if lay.zero >= 1 else dense + experts
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
    """Data-parallel traffic of the non-expert parameters over dp x cp (context-parallel ranks
    reduce their gradients too), plus the routed experts' over their own smaller group."""
    grad_bytes = rank_params(m, lay, t)[0] * state_bytes_per_param(t)[1]
    dp_link = group_link(c, lay.dp * lay.cp, lay.tp)
    experts = _expert_dp_comm(m, lay, t, c, microbatches)
    if lay.zero <= 1:  # DDP: bucketed all-reduces over the whole data-parallel group
        ddp = dp_link.all_reduce(grad_bytes, ddp_buckets(grad_bytes))
        # ZeRO-1 (ZeroRedundancyOptimizer): then every rank's updated shard is gathered.
        return experts + ddp + (dp_link.all_gather(grad_bytes) if lay.zero == 1 else 0.0)
    return experts + _fsdp_comm(m, lay, t, c, microbatches, grad_bytes)


def _expert_dp_comm(m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int) -> float:
    """The routed experts' gradients (and ZeRO-3's gathers) over the ranks that hold the same
    experts (:func:`expert_shard`, about ep apart) and across dp_replicate. ep = dp_shard x cp
    x tp leaves no group to gather over: expert parallel's saving."""
    total = rank_params(m, lay, t)[1] * state_bytes_per_param(t)[1]
    if total <= 0:
        return 0.0
    group = group_link(c, expert_shard(lay), lay.ep)
    replicas = group_link(c, lay.dp_replicate, lay.tp * lay.shard)
    if lay.zero <= 1:
        time = group.all_reduce(total, ddp_buckets(total))
        return time + (group.all_gather(total) if lay.zero == 1 else 0.0)
    calls, units = fsdp_collectives(m, lay, microbatches)
    gathered = microbatches * total * (2.0 if lay.zero >= 3 else 1.0)
    time = group.all_gather(gathered, calls) + group.reduce_scatter(total, units)
    return time + replicas.all_reduce(total / expert_shard(lay), units)


def _fsdp_comm(
    m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int, total: float
) -> float:
    """FSDP2, one collective per unit: all-gather in every micro-batch's forward (ZeRO-3: again
    in its backward, for the blocks; the root stays gathered), one reduce-scatter per step
    (gradient sync only on the boundary micro-batch), across replicas (HSDP) an all-reduce of
    the shard; plus FSDP2's copy-in/copy-out of each gathered and reduced buffer."""
    calls, units = fsdp_collectives(m, lay, microbatches)
    shard = group_link(c, lay.shard, lay.tp)
    blocks = _block_params(m, lay) * state_bytes_per_param(t)[1]  # the root is not regathered
    gathered = microbatches * (total + (blocks if lay.zero >= 3 else 0.0))
    time = shard.all_gather(gathered, calls) + shard.reduce_scatter(total, units)
    replicas = group_link(c, lay.dp_replicate, lay.tp * lay.shard)
    time += replicas.all_reduce(total / lay.shard, units)
    if c.mem_bw > 0:  # copy-in (shard or whole) and copy-out (whole or shard), read + write
        time += 2.0 * (1.0 + 1.0 / lay.shard) * (gathered + total) / c.mem_bw
    return time


def _block_params(m: Model, lay: Layout) -> float:
    """The non-expert parameters of the stage's blocks on one GPU."""
    if not m.has_shape:
        return rank_params(m, lay)[0]
    blocks = math.ceil(m.layers / lay.pp) * m.params_per_layer() - expert_stage_params(m, lay)
    return blocks / lay.tp


def _tp_comm(m: Model, lay: Layout, t: Training, c: Cluster, microbatches: int) -> float:
    """Megatron TP: per layer 2 all-reduces forward and 2 backward (with sequence parallel each
    is an all-gather + a reduce-scatter: the same bytes and ring steps), 6 with full
    recomputation; over the intra-node link; not hidden. Separate q/k/v layers all-reduce
    their input gradients one by one: 2 more all-reduces of the same size in backward."""
    if lay.tp == 1 or not m.has_shape:
        return 0.0
    act = m.seq * lay.micro_batch * m.hidden * _act_elem_bytes(t) / lay.cp
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
    act = m.seq * lay.micro_batch * m.hidden * _act_elem_bytes(t) / (lay.tp * lay.cp)
    link = group_link(c, 2, lay.tp * lay.cp * lay.dp)  # neighbouring stages: a stage apart
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
    # MoE routing other than balanced: the band's other end (the same layout with every expert
    # at the mean) and the routed tokens a capacity factor drops.
    balanced_tokens_per_s: float = 0.0
    dropped: float = 0.0


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
    est = Estimate(lay, microbatches, mem, st, fits, tokens, mfu)
    if m.moe is not None and m.moe.routing.kind != "balanced":
        even = step_time(balanced(m), lay, t, c, microbatches)
        est.balanced_tokens_per_s = t.global_batch * m.seq / even.total
        est.dropped = dropped_fraction(m.moe.routing)
    return est
