"""Split a training state into tensors (for DCP) and plain values (for JSON), and back.

Why split: DCP stores non-tensor values by pickling them and loads them with
``torch.load(weights_only=False)``, which runs arbitrary code from the file. meshrun keeps DCP
for tensors only and writes everything else (optimizer hyper-parameters, scheduler state,
counters, RNG states) as JSON, so loading a checkpoint never unpickles anything but DCP's own
metadata. Also here: capture and restore of the per-rank RNG states.
"""

from __future__ import annotations

import base64
import hashlib
import random
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch

__all__ = [
    "StateError",
    "capture_rng",
    "decode_json",
    "encode_json",
    "encode_tensors",
    "merge_state",
    "restore_rng",
    "split_state",
    "state_digest",
]


class StateError(ValueError):
    """A state value that cannot be checkpointed safely (names its path)."""


def split_state(state: Mapping[str, Any], path: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, plain)``: two nested dicts with the same keys as ``state``; tensor leaves go
    to the first, everything else (JSON-encoded) to the second."""
    tensors: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise StateError(f"{path}{key!r}: state keys must be strings, got {type(key).__name__}")
        here = f"{path}{key}"
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            t, p = split_state(value, here + ".")
            if t:
                tensors[key] = t
            if p or not t:
                plain[key] = p
        else:
            plain[key] = encode_json(value, here)
    return tensors, plain


def merge_state(tensors: Mapping[str, Any], plain: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`split_state`."""
    out: dict[str, Any] = {}
    for key in {**plain, **tensors}:
        t, p = tensors.get(key), plain.get(key)
        if isinstance(t, Mapping) or (t is None and isinstance(p, Mapping) and _is_tree(p)):
            out[key] = merge_state(t or {}, p or {})
        elif t is not None:
            out[key] = t
        else:
            out[key] = decode_json(p)
    return out


def _is_tree(p: Mapping[str, Any]) -> bool:
    # An encoded leaf is a tagged dict ({"__tuple__": ...}); a subtree is any other dict.
    return not (len(p) == 1 and next(iter(p)).startswith("__") and next(iter(p)).endswith("__"))


def encode_json(value: Any, path: str = "value") -> Any:
    """A JSON-safe form of ``value``: tuples, bytes and non-string-keyed dicts are tagged."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode_json(v, path) for v in value]}
    if isinstance(value, list):
        return [encode_json(v, path) for v in value]
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, Mapping):
        return {
            "__dict__": [[encode_json(k, path), encode_json(v, path)] for k, v in value.items()]
        }
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    raise StateError(
        f"{path}: a {type(value).__name__} cannot be checkpointed (only tensors, numbers, "
        "strings, lists, tuples and dicts are): keep it out of state_dict() or convert it"
    )


# The dtypes a tensor saved as JSON may have: a name outside this set is refused on load, so a
# file never makes decode_json look up an arbitrary attribute of torch.
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def encode_tensors(value: Any, path: str = "value") -> Any:
    """:func:`encode_json` that also takes plain tensors: each becomes
    ``{"__tensor__": [dtype, shape, base64 bytes]}`` (exact, and loaded without unpickling).
    For small per-rank state (a carried hidden state, counters): large tensors belong in DCP."""
    if isinstance(value, torch.Tensor):
        name = str(value.dtype).removeprefix("torch.")
        if name not in _DTYPES or type(value) is not torch.Tensor:
            raise StateError(
                f"{path}: a {type(value).__name__} of {value.dtype} cannot be saved per rank "
                f"(plain tensors of {', '.join(sorted(_DTYPES))} can)"
            )
        cpu = value.detach().cpu().contiguous()
        data = cpu.view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
        return {"__tensor__": [name, list(cpu.shape), base64.b64encode(data).decode()]}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: encode_tensors(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [encode_tensors(v, path) for v in value]
        return items if isinstance(value, list) else {"__tuple__": items}
    return encode_json(value, path)


def _decode_tensor(name: str, shape: list[int], data: str) -> torch.Tensor:
    if name not in _DTYPES:
        raise StateError(f"a saved tensor has dtype {name!r}: not one of {sorted(_DTYPES)}")
    raw = bytearray(base64.b64decode(data))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(_DTYPES[name]).reshape(shape).clone()


def state_digest(value: Any) -> int:
    """A 63-bit digest of a state dict's values (tensors by their bytes; DTensors skipped: each
    rank holds its own shard of them by design), to compare one object across ranks."""
    h = hashlib.blake2b(digest_size=8)

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            if type(node) is torch.Tensor:
                h.update(f"{path}:{node.dtype}:{tuple(node.shape)}".encode())
                h.update(node.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(node, Mapping):
            for k in sorted(node, key=str):
                walk(node[k], f"{path}.{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")
        else:
            h.update(f"{path}={node!r}".encode())

    walk(value, "")
    return int.from_bytes(h.digest(), "little") >> 1


def decode_json(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_json(v) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return _decode_tensor(*value["__tensor__"])
        if "__tuple__" in value:
            return tuple(decode_json(v) for v in value["__tuple__"])
        if "__bytes__" in value:
            return base64.b64decode(value["__bytes__"])
        if "__dict__" in value:
            return {decode_json(k): decode_json(v) for k, v in value["__dict__"]}
        return {k: decode_json(v) for k, v in value.items()}
    return value


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (Python, NumPy, torch CPU and every CUDA device) as JSON."""
    np_state = cast("tuple[Any, ...]", np.random.get_state())  # legacy=True: a tuple
    out: dict[str, Any] = {
        "python": encode_json(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *map(encode_json, np_state[2:])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    random.setstate(decode_json(state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *map(decode_json, rest)))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [_bytes_tensor(s) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()
