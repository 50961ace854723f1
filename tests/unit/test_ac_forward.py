"""Activation checkpointing by the block's own forward: it recomputes, keeps every name, gives
the plain model's gradients, and survives ``copy.deepcopy`` and pickling (the copy's forward
runs the copied block)."""

from __future__ import annotations

import copy
import pickle

import torch
from torch import Tensor, nn

from meshrun.parallel.ac import apply_ac, is_checkpointed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.calls = 0

    def forward(self, x: Tensor, scale: float = 1.0) -> Tensor:
        self.calls += 1
        return x + scale * self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5)  # a keyword argument goes through checkpoint too
        return x.square().mean()


def grads(model: nn.Module, x: Tensor) -> list[Tensor]:
    model.zero_grad()
    model(x).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_checkpointed_blocks_recompute_keep_names_and_gradients() -> None:
    torch.manual_seed(0)
    plain, x = Net(), torch.randn(4, 8)
    model = copy.deepcopy(plain)
    names = [n for n, _ in model.named_modules()]
    assert apply_ac(model, 1) == 2
    assert [n for n, _ in model.named_modules()] == names
    assert [n for n, m in model.named_modules() if is_checkpointed(m)] == ["blocks.0", "blocks.1"]
    want = grads(plain, x)
    for net in (model, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        before = [b.calls for b in net.blocks]
        got = grads(net, x)
        # Each block's forward ran twice: once in the forward, once recomputed in the backward.
        assert [b.calls - n for b, n in zip(net.blocks, before, strict=True)] == [2, 2]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert all(b.forward.module is b for b in net.blocks)  # type: ignore[attr-defined]
    assert apply_ac(model, 1) == 2 and model.blocks[0].forward.function is Block.forward
