"""Per-rank objects are saved as JSON, tensors included (checkpoint/state.py): exact round trips,
no unpickling, a fixed list of dtypes (checked before any bytes are read), and the digest that
compares a replicated object across ranks (no processes)."""

from __future__ import annotations

import json

import pytest
import torch

from meshrun.checkpoint.state import StateError, decode_json, encode_tensors, state_digest


def round_trip(value: object) -> object:
    return decode_json(json.loads(json.dumps(encode_tensors(value))))


def test_tensors_round_trip_bitwise() -> None:
    g = torch.Generator().manual_seed(0)
    state = {
        "h": torch.randn(1, 4, 16, generator=g),
        "bf16": torch.randn(3, generator=g).bfloat16(),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(5, dtype=torch.int64),
        "empty": torch.empty(0, 2),
        "nan": torch.tensor([float("nan"), -0.0]),
        "pair": (torch.ones(2), "tag", 3),
        "n": 7,
    }
    back = round_trip(state)
    assert isinstance(back, dict) and back.keys() == state.keys()
    for key in ("h", "bf16", "mask", "ids", "empty", "nan"):
        a, b = state[key], back[key]
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.view(torch.uint8).tolist() == b.view(torch.uint8).tolist()  # NaN and -0.0 too
    assert isinstance(back["pair"], tuple) and back["pair"][1:] == ("tag", 3)
    assert back["n"] == 7


def test_an_unlisted_dtype_is_refused_on_save_and_on_load() -> None:
    with pytest.raises(StateError, match=r"per_rank\.z: a Tensor of torch.complex64"):
        encode_tensors({"z": torch.zeros(2, dtype=torch.complex64)}, "per_rank")
    forged = {"__tensor__": ["Storage", [1], "AAAA"]}  # a name torch has, not a dtype we list
    with pytest.raises(StateError, match="dtype 'Storage'"):
        decode_json(forged)


def test_digest_follows_values_not_key_order() -> None:
    a = {"t": torch.ones(3), "n": 1}
    assert state_digest(a) == state_digest({"n": 1, "t": torch.ones(3)})
    assert state_digest(a) != state_digest({"t": torch.ones(3), "n": 2})
    assert state_digest(a) != state_digest({"t": torch.tensor([1.0, 1.0, 1.0 + 2**-20]), "n": 1})
    assert 0 <= state_digest(a) < 2**63  # fits the int64 tensor the ranks all-gather
