"""The shape of a model built on the meta device, each field with where it was found.

Read in this order, the first that answers wins (command-line flags win over all, in cli/plan.py):
the model's config (a Hugging Face config, or a ``config``/``cfg``/``args`` object or dict on
the module, with Hugging Face, GPT-2/nanoGPT and Llama names), then the modules themselves
(the repeated blocks are the longest ``nn.ModuleList``/``nn.ModuleDict`` of modules of one
class; heads from attention attributes on a block; hidden and vocab from the largest
embedding; the MLP width and the q/k/v layout from a block's projections). What nothing
answers is left out, and cli/plan.py names the flag that gives it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Attribute names used by common model configs for each shape field, in the order tried.
SHAPE_NAMES = {
    "layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim", "embed_dim"),
    "heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_heads", "n_kv_head", "num_kv_heads"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "d_ff"),
    "vocab": ("vocab_size", "n_vocab"),
    "seq": ("max_position_embeddings", "n_positions", "block_size", "seq_len", "max_seq_len"),
}
CONFIG_ATTRS = ("config", "cfg", "args", "model_args", "params")
HEAD_ATTRS = {k: SHAPE_NAMES[k] for k in ("heads", "kv_heads")}


@dataclass
class Inspected:
    """What the model says about itself: exact counts, and each shape field with its source."""

    class_name: str
    params: int
    layers: int  # blocks found (0: none)
    layer_params: int  # parameters of one block (0: no blocks found)
    shape: dict[str, int] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # field -> where it was read
    tied: list[tuple[str, str]] = field(default_factory=list)  # (first name, another name)
    gated: bool | None = None  # SwiGLU-style MLP; None: not found
    separate_qkv: bool | None = None
    config_values: dict[str, Any] = field(default_factory=dict)  # the config's own fields
    config_source: str = ""  # where the config was found ("config", "cfg", ...)


def inspect_module(model: Any, config: Any = None) -> Inspected:
    """Count ``model``'s parameters and find its shape (``config``: the model's own config,
    e.g. a Hugging Face one; else looked for on the module)."""
    found = Inspected(type(model).__name__, sum(p.numel() for p in model.parameters()), 0, 0)
    config, where = (config, "config") if config is not None else _config_of(model)
    if config is not None:
        _read_config(found, config, where)
    _read_embeddings(found, model)
    blocks = find_blocks(model)
    if blocks is not None:
        name, block, count = blocks
        found.layers, found.layer_params = count, sum(p.numel() for p in block.parameters())
        # The blocks counted win over a config's number: they are what the memory holds.
        found.shape["layers"] = count
        found.sources["layers"] = f"{name} ({count} x {type(block).__name__})"
        _read_block(found, block, f"{name}.0")
    found.tied = tied_parameters(model)
    return found


def _config_of(model: Any) -> tuple[Any, str]:
    for attr in CONFIG_ATTRS:
        value = getattr(model, attr, None)
        if value is not None and not callable(value) and _fields(value):
            return value, attr
    return None, ""


def _fields(config: Any) -> dict[str, Any]:
    """A config's own fields: a mapping's items, else the instance's attributes (not
    Hugging Face's attribute_map aliases, so that a GPT-2 config reports n_embd)."""
    if isinstance(config, Mapping):
        return dict(config)
    try:
        return dict(vars(config))
    except TypeError:
        return {}


def _read_config(found: Inspected, config: Any, where: str) -> None:
    values = _fields(config)
    found.config_values, found.config_source = values, where
    for key, names in SHAPE_NAMES.items():
        for name in names:
            value = values.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                _put(found, key, value, f"{where}.{name}")
                break


def _put(found: Inspected, key: str, value: int, source: str) -> None:
    if key not in found.shape:
        found.shape[key], found.sources[key] = value, source


def find_blocks(model: Any) -> tuple[str, Any, int] | None:
    """The repeated blocks: the longest ``nn.ModuleList`` / ``nn.ModuleDict`` whose children
    are all of one class, other than an MoE layer's ``experts`` (name, first block, count);
    None when there is none."""
    from torch import nn

    best: tuple[str, Any, int] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) == 0:
            continue
        if name.rpartition(".")[2] == "experts":  # an MoE layer's experts, not the blocks
            continue
        children = list(module.children())
        if len({type(c) for c in children}) == 1 and (best is None or len(children) > best[2]):
            best = (name, children[0], len(children))
    return best


def _read_block(found: Inspected, block: Any, prefix: str) -> None:
    for key, names in HEAD_ATTRS.items():
        hit = _block_attribute(block, names)
        if hit is not None:
            _put(found, key, hit[1], f"{prefix}.{hit[0]}")
    hidden = found.shape.get("hidden")
    if hidden is None:
        return
    projections = _projections(block)
    mlp = _read_mlp(found, projections, hidden, prefix)
    _read_qkv(found, [p for p in projections if p[0] not in mlp], prefix)


def _read_mlp(
    found: Inspected, projections: list[tuple[str, int, int]], hidden: int, prefix: str
) -> set[str]:
    """The MLP: its down projection (from the config's ffn, else the widest back to hidden),
    and beside it, in the same module, its up (and gate) projections; their names returned.
    Shapes alone cannot tell a fused qkv from an up projection when ffn = 3 x hidden."""
    back = [(n, i) for n, i, o in projections if o == hidden and i != hidden]
    if not back:
        return set()
    ffn = found.shape.get("ffn")
    down, width = next(((n, i) for n, i in back if i == ffn), max(back, key=lambda b: b[1]))
    _put(found, "ffn", width, f"{prefix}.{down} (the widest projection back to hidden)")
    ffn, parent = found.shape["ffn"], down.rpartition(".")[0]
    up = [
        (n, o)
        for n, i, o in projections
        if n.rpartition(".")[0] == parent and i == hidden and o in (ffn, 2 * ffn)
    ]
    if up:
        found.gated = len(up) >= 2 or any(o == 2 * ffn for _, o in up)  # gate+up, or fused
        names = ", ".join(n for n, _ in up)
        found.sources["mlp"] = f"{len(up)} projection(s) hidden->ffn beside {down}: {names}"
    return {down} | {n for n, _ in up}


def _block_attribute(block: Any, names: tuple[str, ...]) -> tuple[str, int] | None:
    for mod_name, module in block.named_modules():
        for name in names:
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return (f"{mod_name}.{name}" if mod_name else name), value
    return None


def _projections(block: Any) -> list[tuple[str, int, int]]:
    """(name, in, out) of a block's matmul layers: nn.Linear, and Hugging Face's GPT-2
    ``Conv1D`` (weight stored transposed, sizes in ``nx``/``nf``)."""
    from torch import nn

    out = []
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear):
            out.append((name, module.in_features, module.out_features))
        elif isinstance(getattr(module, "nx", None), int) and isinstance(
            getattr(module, "nf", None), int
        ):
            out.append((name, module.nx, module.nf))
    return out


def _read_qkv(found: Inspected, projections: list[tuple[str, int, int]], prefix: str) -> None:
    """Separate q/k/v layers (each split by TP with its own backward all-reduce) or one fused
    qkv: three or more hidden -> heads*head_dim or kv_heads*head_dim projections mean separate."""
    hidden, heads = found.shape.get("hidden"), found.shape.get("heads")
    if not hidden or not heads:
        return
    head_dim = hidden // heads
    widths = {heads * head_dim, found.shape.get("kv_heads", heads) * head_dim}
    qkv = [n for n, i, o in projections if i == hidden and o in widths]
    fused = [n for n, i, o in projections if i == hidden and o == 3 * hidden]
    if len(qkv) >= 3 or fused:
        found.separate_qkv = len(qkv) >= 3
        names = qkv[:3] if found.separate_qkv else fused[:1]
        found.sources["qkv"] = f"{prefix}: " + ", ".join(names)


def _read_embeddings(found: Inspected, model: Any) -> None:
    from torch import nn

    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return
    name, emb = max(embeddings, key=lambda item: item[1].num_embeddings)
    label = f"{name} (nn.Embedding {emb.num_embeddings} x {emb.embedding_dim})"
    _put(found, "vocab", emb.num_embeddings, label)
    _put(found, "hidden", emb.embedding_dim, label)


def tied_parameters(model: Any) -> list[tuple[str, str]]:
    """Parameters reachable under two names (a head tied to the token embedding)."""
    first: dict[int, str] = {}
    tied = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied.append((first[id(p)], name))
        else:
            first[id(p)] = name
    return tied


__all__ = ["SHAPE_NAMES", "Inspected", "find_blocks", "inspect_module", "tied_parameters"]
