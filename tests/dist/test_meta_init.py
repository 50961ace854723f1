"""A model built on the meta device starts from one process's values under every layout.

The model is written the way users write it (the shape of pytorch/examples' FSDP2 Transformer:
attention with ``wq/wk/wv/wo``, a feed-forward, LayerNorm and an RMSNorm of its own, token and
position embeddings, an ``init_weights`` that calls each layer's ``reset_parameters()`` and
``nn.init.normal_``/``trunc_normal_``). One process builds it on meta and lets ``parallelize``
allocate and initialise it; one 2-rank launch does the same under ZeRO-3, tensor parallel 2 and
a 2-stage pipeline (a heavy 4-rank variant: HSDP 2x2, FSDP 2 x TP 2, PP 2 x ZeRO-3 2),
gathers the full parameters (``full_tensor()``, every stage's) and the
step-1 loss. Each must equal one process's: the parameters bitwise (the initialiser runs once
on full tensors, from the same RNG stream), the loss within rounding. Before meshrun ran the
initialiser on full tensors, every rank drew its shard from the same seed (a weight was one
shard repeated) and a later stage drew as if it were the first.

An initialiser that leaves a parameter unset is refused naming it (one process, no launch).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from _dist import run_distributed
from meshrun.config import ParallelConfig, check_layout
from meshrun.parallel import parallelize, parallelize_pipeline, pipeline_step
from meshrun.runtime.mesh import ParallelDims, build_mesh

DIM, HEADS, LAYERS, VOCAB, SEQ, BATCH = 32, 4, 2, 64, 16, 4
CPU = torch.device("cpu")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def reset_parameters(self) -> None:
        for w in (self.wq, self.wk, self.wv, self.wo):
            w.reset_parameters()


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 4 * DIM)
        self.w2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.gelu(self.w1(x)))

    def reset_parameters(self) -> None:
        self.w1.reset_parameters()
        self.w2.reset_parameters()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))

    def reset_parameters(self) -> None:
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters()


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def init_weights(self) -> None:
        self.tok_embeddings.reset_parameters()
        nn.init.normal_(self.pos_embeddings.weight, std=0.02)
        for layer in self.layers:
            layer.reset_parameters()  # type: ignore[operator]
        self.norm.reset_parameters()
        nn.init.trunc_normal_(self.output.weight, std=1 / math.sqrt(DIM), a=-0.1, b=0.1)


def build_on_meta() -> Transformer:
    torch.manual_seed(0)
    with torch.device("meta"):
        return Transformer()


def batch() -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def full_state(modules: list[nn.Module]) -> dict[str, Tensor]:
    """The whole parameters and buffers (a collective for DTensors: every rank calls it)."""
    out = {}
    for m in modules:
        for k, v in m.state_dict().items():
            out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def one_process() -> dict[str, Any]:
    model = parallelize(build_on_meta(), None, ParallelConfig(), CPU)
    x, y = batch()
    return {"params": full_state([model]), "loss": float(lm_loss(model(x), y).detach())}


def under_layout(layout: dict[str, Any]) -> dict[str, Any]:
    cfg = ParallelConfig(**layout)
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    check_layout(cfg, vars(dims))
    mesh = build_mesh(dims, "cpu")
    x, y = batch()
    if dims.pp > 1:
        pipe = parallelize_pipeline(build_on_meta(), mesh, cfg, CPU, lm_loss)
        loss = float(pipeline_step(pipe, x, y))  # the forward's loss, before any update
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, full_state(list(pipe.modules)))
        return {"params": {k: v for d in everyone for k, v in d.items()}, "loss": loss}
    model = parallelize(build_on_meta(), mesh, cfg, CPU)
    out = model(x)  # every rank the whole batch: the loss of one process's first step
    logits = out.full_tensor() if isinstance(out, DTensor) else out
    return {"params": full_state([model]), "loss": float(lm_loss(logits, y))}


LAYOUTS: dict[str, dict[str, Any]] = {
    "ZeRO-3 2": {"zero": 3},
    "TP 2": {"tp": 2},
    "PP 2": {"pp": 2, "pp_microbatches": 2},
}


FOUR_RANKS: dict[str, dict[str, Any]] = {
    "HSDP 2x2": {"zero": 3, "dp_replicate": 2},
    "FSDP 2 x TP 2": {"zero": 3, "tp": 2},  # FSDP2 shards TP's shards: _StridedShard
    "PP 2 x ZeRO-3 2": {"pp": 2, "zero": 3, "pp_microbatches": 2},
}


def meta_layouts(rank: int, world_size: int, layouts: dict[str, Any]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    return {name: under_layout(layout) for name, layout in layouts.items()}


@pytest.mark.timeout(180)
def test_meta_model_starts_from_one_process_values_under_each_layout() -> None:
    check_against_one_process(LAYOUTS, 2)


# heavy: test_meta_model_starts_from_one_process_values_under_each_layout (ZeRO-3, TP, PP)
@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_meta_model_on_four_ranks_hsdp_tp_x_fsdp_pp_x_zero3() -> None:
    check_against_one_process(FOUR_RANKS, 4)


def check_against_one_process(layouts: dict[str, Any], nproc: int) -> None:
    ref = one_process()
    results = run_distributed(meta_layouts, nproc, layouts, timeout=200)[0]
    wrong = {}  # every layout's verdict in one message
    for name, got in results.items():
        assert set(got["params"]) == set(ref["params"]), name
        differ = [k for k, v in ref["params"].items() if not torch.equal(got["params"][k], v)]
        if differ or got["loss"] != pytest.approx(ref["loss"], rel=1e-6):
            wrong[name] = (f"loss {got['loss']:.6f} vs {ref['loss']:.6f}", differ[:3])
    assert not wrong, wrong


class Forgets(Transformer):
    def init_weights(self) -> None:  # the last norm left as to_empty left it
        self.tok_embeddings.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()  # type: ignore[operator]
        nn.init.normal_(self.pos_embeddings.weight)
        nn.init.normal_(self.output.weight)


@pytest.mark.timeout(60)
def test_an_init_that_leaves_a_parameter_unset_is_refused_naming_it() -> None:
    with torch.device("meta"):
        model = Forgets()
    with pytest.raises(TypeError, match=r"left \['norm.bias', 'norm.weight'\] unset"):
        parallelize(model, None, ParallelConfig(), CPU)
