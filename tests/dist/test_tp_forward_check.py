"""Tensor parallel on attention written the way users write it, on 2 Gloo ranks, one launch.

- pytorch/examples' FSDP2 model (``wq/wk/wv/wo``, ``.view(bsz, seq_len, self.n_heads,
  self.head_dim)``) under tp = 2: refused by ``parallelize`` before any step, naming the
  attention, the line of this file and the fix (``-1``, ``n_heads // tp``); the RNG stream is
  left as it was. The same model with ``-1`` for the head count trains like one process.
- A model whose input is already embedded (no ``nn.Embedding`` to derive an input from):
  refused before step 1 with ``ModelSpec(example_input=...)``; without one, the first forward's
  error carries the same explanation as a note.
- 3 heads, tp = 2: the MLP-only plan (which leaves the attention whole) trains like one
  process; the default plan, which splits q/k/v/o, is refused for the head count.

Per-step losses and final parameters are compared with one process (fp32, the same global
batch, SGD with momentum) within 1e-6 relative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from _dist import run_distributed
from meshrun.config import ConfigError, ParallelConfig
from meshrun.parallel import parallelize
from meshrun.parallel.structure import ModelSpec
from meshrun.runtime.mesh import ParallelDims, build_mesh

BATCH, SEQ, STEPS, LR, RTOL = 4, 8, 3, 0.1, 1e-6
VOCAB = 32


class Attention(nn.Module):
    """The attention of pytorch/examples' distributed/FSDP2/model.py (dropout 0 here)."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.n_heads = n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        bsz, seq_len, _ = x.size()
        queries, keys, values = self.wq(x), self.wk(x), self.wv(x)
        queries = queries.view(bsz, seq_len, self.n_heads, self.head_dim)  # the full head count
        keys = keys.view(bsz, seq_len, self.n_heads, self.head_dim)
        values = values.view(bsz, seq_len, self.n_heads, self.head_dim)
        return self.wo(self.attend(queries, keys, values))

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        bsz, seq_len = q.shape[:2]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2).contiguous().view(bsz, seq_len, -1)


class LocalHeadsAttention(Attention):
    """The same attention with ``-1`` for the head count: the local heads under a split."""

    def forward(self, x: Tensor) -> Tensor:
        bsz, seq_len, _ = x.size()
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        return self.wo(self.attend(q, k, v))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, attention: type[Attention]) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = attention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """pytorch/examples' FSDP2 Transformer, small: token and position embeddings, blocks,
    a final norm and an output layer."""

    def __init__(self, dim: int = 32, n_heads: int = 4, attention: type = Attention) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.pos_embeddings = nn.Embedding(SEQ, dim)
        self.layers = nn.ModuleList([Block(dim, n_heads, attention) for _ in range(2)])
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        _bsz, seq_len = tokens.size()
        assert seq_len <= SEQ
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(seq_len))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)).float()


class Embedded(nn.Module):
    """Blocks on an already-embedded input (its first layer is a Linear): meshrun cannot
    derive an input for it."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([Block(dim, 4, Attention) for _ in range(2)])

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj_in(x)
        for layer in self.layers:
            h = layer(h)
        return h


def _seeded(build: Any) -> nn.Module:
    torch.manual_seed(0)
    return build()


BUILDERS = {
    "view n_heads": lambda: _seeded(Transformer),
    "view -1": lambda: _seeded(lambda: Transformer(attention=LocalHeadsAttention)),
    "3 heads": lambda: _seeded(lambda: Transformer(48, 3, LocalHeadsAttention)),
}
MLP_ONLY = {"layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w2": "rowwise"}
VIEW_LINE = next(
    i
    for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
    if "# the full head count" in line
)


def data() -> Tensor:
    return torch.randint(
        0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )


def loss_of(model: nn.Module, tokens: Tensor) -> Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(model: nn.Module) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, data()[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.named_parameters()
    }
    return {"losses": losses, "params": params}


def _parallelize(model: nn.Module, **options: Any) -> tuple[nn.Module, bool]:
    """parallelize under tp = 2; whether the CPU RNG stream is as it was."""
    cfg = ParallelConfig(tp=2)
    mesh = build_mesh(ParallelDims.from_config(cfg, dist.get_world_size()), "cpu")
    before = torch.get_rng_state()
    out = parallelize(model, mesh, cfg, torch.device("cpu"), **options)
    return out, bool(torch.equal(before, torch.get_rng_state()))


def refused(build: Any, **options: Any) -> str:
    try:
        _parallelize(build(), **options)
    except ConfigError as e:
        return str(e)
    return "not refused"


def first_forward_error(model: nn.Module) -> str:
    """The error of the first real forward of the embedded model, with its notes."""
    model, _ = _parallelize(model)
    try:
        model(torch.zeros(2, SEQ, 32))
    except RuntimeError as e:
        return "\n".join([str(e), *getattr(e, "__notes__", [])])
    return "no error"


def cases(rank: int, world_size: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    model, rng_kept = _parallelize(BUILDERS["view -1"]())
    out: dict[str, Any] = {"view -1": train(model), "rng kept": rng_kept}
    try:
        out["3 heads MLP only"] = train(_parallelize(BUILDERS["3 heads"](), tp_plan=MLP_ONLY)[0])
    except ConfigError as e:  # refused before (the heads an MLP-only plan never splits)
        out["3 heads MLP only"] = {"refused": str(e)}
    out["3 heads default plan"] = refused(BUILDERS["3 heads"])
    out["view n_heads"] = refused(BUILDERS["view n_heads"])
    example = ModelSpec(example_input=torch.zeros(2, SEQ, 32))
    out["embedded, example input"] = refused(lambda: _seeded(Embedded), spec=example)
    out["embedded, first forward"] = first_forward_error(_seeded(Embedded))
    return out


def check_numerics(label: str, got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert "refused" not in got, f"{label}: {got.get('refused')}"
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"{label} step {step + 1}: loss {a} vs {b}"
    assert got["params"].keys() == ref["params"].keys(), label
    diff = max(float((v - ref["params"][k]).abs().max()) for k, v in got["params"].items())
    assert diff <= 1e-5, f"{label}: max |param - reference| = {diff:.3g}"


@pytest.mark.timeout(240)
def test_tp_plans_checked_against_the_users_forward() -> None:
    results = run_distributed(cases, 2, timeout=210)
    for r in results:  # every rank refuses alike, before any step
        why = r["view n_heads"]
        assert why.startswith(
            "tensor parallel over 2 ranks breaks the forward of layers.0.attention (Attention, "
            f"{__file__}:{VIEW_LINE}: `queries = queries.view(bsz, seq_len, self.n_heads, "
            "self.head_dim)  # the full head count`): RuntimeError: shape '[2, 4, 4, 8]' is "
            "invalid for input of size 128; the plan splits wq, wk, wv column-wise"
        ), why
        assert "-1 in place of the head count" in why and "n_heads // tp" in why, why
        assert r["3 heads default plan"].startswith(
            "parallel.tp = 2 does not divide layers.0.attention.n_heads = 3: each "
            "tensor-parallel rank must hold whole heads; choose tp in [1, 3]"
        ), r["3 heads default plan"]
        assert "breaks the forward of layers.0.attention" in r["embedded, example input"]
        noted = r["embedded, first forward"]
        assert "is invalid for input of size" in noted, noted
        assert (
            f"meshrun: tensor parallel over 2 ranks breaks the forward of layers.0.attention (Attention, {__file__}:{VIEW_LINE}"
            in noted
        ), noted
        assert r["rng kept"]
    got = results[0]
    check_numerics("view -1", got["view -1"], train(BUILDERS["view -1"]()))
    check_numerics("3 heads MLP only", got["3 heads MLP only"], train(BUILDERS["3 heads"]()))
