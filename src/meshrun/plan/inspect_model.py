"""``--model pkg.module:factory``: count a real module's parameters on the meta device.

The factory is called under ``torch.device("meta")``, so no memory is allocated however large
the model. The block structure is the longest ``nn.ModuleList`` (the repeated layers); shape
fields the planner needs for activations and FLOPs are read from a config object on the model
(``config`` or ``cfg``, Hugging Face or nanoGPT names) unless given on the command line.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from meshrun.plan.search import PlanError

# Attribute names used by common model configs for each shape field.
SHAPE_NAMES = {
    "layers": ("num_hidden_layers", "n_layer", "n_layers"),
    "hidden": ("hidden_size", "d_model", "n_embd", "dim"),
    "heads": ("num_attention_heads", "n_head", "n_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads"),
    "vocab": ("vocab_size",),
    "seq": ("seq_len", "max_position_embeddings", "block_size", "n_positions", "max_seq_len"),
    "ffn": ("intermediate_size", "ffn_dim"),
}


@dataclass
class Inspected:
    """What the module says about itself."""

    params: int
    layers: int
    layer_params: int
    shape: dict[str, int]  # shape fields found on its config


def load_factory(spec: str) -> Any:
    """Import ``pkg.module:factory`` and return the callable, or an error naming the part."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PlanError(f"--model {spec!r}: expected pkg.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PlanError(f"--model {spec!r}: cannot import {module_name!r}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise PlanError(f"--model {spec!r}: {module_name} has no callable {attr!r}")
    return factory


def inspect_model(spec: str) -> Inspected:
    """Build the model on the meta device and count its parameters and blocks."""
    import torch
    from torch import nn

    factory = load_factory(spec)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise PlanError(f"--model {spec!r} returned {type(model).__name__}, not an nn.Module")
    params = sum(p.numel() for p in model.parameters())
    blocks = max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len,
                 default=None)  # fmt: skip
    layers = len(blocks) if blocks is not None else 0
    layer_params = (
        sum(p.numel() for p in blocks[0].parameters()) if blocks is not None and layers else 0
    )
    return Inspected(params, layers, layer_params, _shape_from_config(model))


def _shape_from_config(model: Any) -> dict[str, int]:
    config = getattr(model, "config", None) or getattr(model, "cfg", None)
    found: dict[str, int] = {}
    if config is None:
        return found
    for field, names in SHAPE_NAMES.items():
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                found[field] = value
                break
    mult = getattr(config, "ffn_mult", None)  # nanoGPT-style width multiplier
    if "ffn" not in found and isinstance(mult, int) and "hidden" in found:
        found["ffn"] = mult * found["hidden"]
    return found
