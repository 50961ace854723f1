"""Activation checkpointing keeps the user's names, and says the same thing under every layout.

- minGPT's ``configure_optimizers`` groups parameters by ``named_modules()`` and
  ``named_parameters()`` names (weight decay on Linear weights only). After
  ``parallelize(..., activation_checkpoint=1)`` under ZeRO-3 on 2 ranks it must find every
  parameter (torch's ``checkpoint_wrapper`` put ``_checkpoint_wrapped_module`` into the names:
  ``KeyError`` before step 1), and the run must train like one process (AdamW, 4 steps).
- A model with no repeated blocks (an LSTM LM): under DDP and under ZeRO-3 one warning says
  that activation checkpointing wraps nothing, and why (ZeRO-3 said only FSDP's part).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

import byo_models
from _dist import run_distributed
from meshrun.config import ParallelConfig
from meshrun.runtime.mesh import ParallelDims, build_mesh
from meshrun.parallel import parallelize

STEPS = 4
GLOBAL_BATCH = 8
RTOL = 1e-6


def configure_optimizers(model: nn.Module, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """minGPT's grouping (model.py ``configure_optimizers``), as a user's script has it: every
    module's parameters, recursively (a parameter is seen under each of its ancestors), decay
    for Linear weights, none for biases and LayerNorm/Embedding weights, then looked up by
    the model's own parameter names."""
    decay, no_decay = set(), set()
    for mn, m in model.named_modules():
        for pn, _ in m.named_parameters():
            fpn = f"{mn}.{pn}" if mn else pn
            if pn.endswith("bias"):
                no_decay.add(fpn)
            elif pn.endswith("weight") and isinstance(m, nn.Linear):
                decay.add(fpn)
            elif pn.endswith("weight") and isinstance(m, (nn.LayerNorm, nn.Embedding)):
                no_decay.add(fpn)
    params = dict(model.named_parameters())
    groups = [
        {"params": [params[n] for n in sorted(decay)], "weight_decay": weight_decay},
        {"params": [params[n] for n in sorted(no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, foreach=False)


def build() -> nn.Module:
    torch.manual_seed(0)
    model = byo_models.NanoGPT()
    # minGPT's head is not tied to the embedding (its grouping would name lm_head.weight twice)
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def data() -> Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 16, (STEPS, GLOBAL_BATCH, byo_models.SEQ + 1), generator=g)


def loss_of(model: nn.Module, tokens: Tensor) -> Tensor:
    logits = byo_models.logits_of(model, tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def train(model: nn.Module, batches: Tensor, group: Any = None, world: int = 1) -> list[float]:
    opt, losses = configure_optimizers(model), []
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(float(total) / world)
    return losses


class LSTMLM(nn.Module):
    """No repeated blocks: an embedding, a 2-layer nn.LSTM and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(16, 8), nn.LSTM(8, 8, 2), nn.Linear(8, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(self.emb(x))[0])


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def no_block_warnings(zero: int) -> list[str]:
    """meshrun's warnings when ``parallelize`` checkpoints a model with no blocks."""
    cfg = ParallelConfig(zero=zero, activation_checkpoint=1)
    mesh = build_mesh(ParallelDims.from_config(cfg, dist.get_world_size()), "cpu")
    handler, log = _Records(), logging.getLogger("meshrun")
    log.addHandler(handler)
    try:
        parallelize(LSTMLM(), mesh, cfg, torch.device("cpu"))
    finally:
        log.removeHandler(handler)
    warnings = [r for r in handler.records if r.levelno == logging.WARNING]
    # Every rank reaches the same warning: none is marked as its own (runtime/logs.py: rank 0 prints).
    assert not any(getattr(r, "per_rank", False) for r in warnings)
    return [r.getMessage() for r in warnings]


def check_ranks(rank: int, world_size: int) -> dict[str, Any]:
    dist.init_process_group("gloo")
    cfg = ParallelConfig(zero=3, activation_checkpoint=1)
    mesh = build_mesh(ParallelDims.from_config(cfg, world_size), "cpu")
    model = parallelize(build(), mesh, cfg, torch.device("cpu"))
    names = [n for n, _ in model.named_modules()]
    per_rank = GLOBAL_BATCH // world_size
    batches = data()[:, rank * per_rank : (rank + 1) * per_rank]
    losses = train(model, batches, mesh.get_group("dp"), world_size)
    params = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
        for k, v in model.named_parameters()
    }
    return {
        "names": names,
        "losses": losses,
        "params": params,
        "ddp": no_block_warnings(0),
        "zero3": no_block_warnings(3),
    }


@pytest.mark.timeout(200)
def test_ac_keeps_names_and_warns_alike_under_every_layout() -> None:
    reference = build()
    ref_names = [n for n, _ in reference.named_modules()]
    ref_losses = train(reference, data())
    results = run_distributed(check_ranks, 2, timeout=170)
    got = results[0]
    assert got["names"] == ref_names  # the user's names, not _checkpoint_wrapped_module
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step + 1}: loss {a} vs {b}"
    ref_params = dict(reference.named_parameters())
    diff = max(float((got["params"][k] - p.detach()).abs().max()) for k, p in ref_params.items())
    # AdamW divides by the gradient's own scale: a gradient near zero that differs in its last
    # bits (a sum over 2 shards) moves its parameter by up to lr; measured 1.8e-5 here.
    assert diff <= 1e-4, diff
    why = "no repeated blocks found in LSTMLM: {}activation checkpointing wraps nothing"
    for r in results:
        assert r["ddp"] == [
            f"{why.format('')}; pass run.parallelize(model, spec=ModelSpec(blocks="
            "'path.to.blocks')) or wrap=..."
        ]
        assert len(r["zero3"]) == 1 and r["zero3"][0].startswith(
            why.format(
                "FSDP2 shards the whole model as one unit (all its parameters gathered) and "
            )
        ), r["zero3"]
    print(f"losses {got['losses']}, param diff {diff:.2g}")
