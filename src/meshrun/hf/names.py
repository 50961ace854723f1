"""Names between a checkpoint and a model: which checkpoint tensor fills which model tensor.

Pure (no torch, no files), so every rule is unit-tested without processes.

- A model's names are first cleaned of what wrappers add inside a path
  (``_checkpoint_wrapped_module.`` from activation checkpointing, ``_orig_mod.`` from
  ``torch.compile``, ``_fsdp_wrapped_module.``); a DDP wrapper is unwrapped before (its
  ``module.``), so a parallelized model has the names of the one it was built from.
- Then the names match exactly, or after one consistent prefix difference: the checkpoint's
  keys carry a prefix the model's lack (a ``LlamaModel`` loaded from a ``LlamaForCausalLM``
  directory: ``model.``), or the model's carry one the checkpoint's lack (``transformer.``,
  a user's wrapper ``module.``); names without the prefix on the side that has it are looked
  up as they are (nanoGPT's ``lm_head`` beside ``transformer.h.*``). The rule that resolves the most model names wins; exact wins
  ties, and a rule is only taken when it resolves more.
- A model tensor tied to others (one tensor under two names, or a declared tie) is filled from
  its own name if the checkpoint has it, else from a tied name's (``save_pretrained`` writes
  one name of a tied pair: ``lm_head.weight`` is absent when tied to the embeddings).
- What is left is the error: names missing from the checkpoint, names the model lacks, and
  shapes that differ, each with a count and a few examples.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "WRAPPER_PARTS",
    "NameMap",
    "PretrainedError",
    "clean_name",
    "match_names",
    "mismatch_text",
]

# Path components only wrappers insert; never a user's own module name.
WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
KNOWN_PREFIXES = ("model.", "transformer.", "module.", "base_model.", "backbone.", "_orig_mod.")
EXAMPLES = 5  # names shown per kind in an error


class PretrainedError(ValueError):
    """Pretrained weights that do not fit the model; the message lists what and how to fix."""


def clean_name(fqn: str) -> str:
    """``fqn`` without the components wrappers insert (activation checkpointing, compile)."""
    return ".".join(p for p in fqn.split(".") if p not in WRAPPER_PARTS)


@dataclass(frozen=True)
class NameMap:
    """The checkpoint name each model name reads, the rule that matched, and what is left."""

    sources: dict[str, str]  # model name -> checkpoint name
    rule: str  # "exact", "checkpoint prefix 'model.' dropped", "prefix 'model.' added"
    missing: list[str] = field(default_factory=list)  # model names without a checkpoint tensor
    unexpected: list[str] = field(default_factory=list)  # checkpoint names no model name reads


def _rules(model_keys: Collection[str], ckpt_keys: Collection[str]) -> list[tuple[str, str]]:
    """The candidate rules: exact first, then each prefix dropped from the checkpoint's names
    or added to the model's (known prefixes and every first component seen)."""
    firsts = {k.split(".", 1)[0] + "." for k in (*model_keys, *ckpt_keys) if "." in k}
    prefixes = [*KNOWN_PREFIXES, *sorted(firsts - set(KNOWN_PREFIXES))]
    return [("exact", ""), *((kind, p) for p in prefixes for kind in ("drop", "add"))]


def _lookup(kind: str, prefix: str, ckpt_keys: Collection[str]) -> dict[str, str]:
    """Model-side name -> checkpoint name under one rule (for the names it can reach)."""
    if kind == "exact":
        return {c: c for c in ckpt_keys}
    if kind == "drop":  # the checkpoint's names carry ``prefix``; names without it stay
        out = {c: c for c in ckpt_keys if not c.startswith(prefix)}
        out.update({c[len(prefix) :]: c for c in ckpt_keys if c.startswith(prefix)})
        return out
    # "add": the model's names carry ``prefix`` that the checkpoint's lack (names of the model
    # without it, e.g. a head beside a prefixed body, are looked up as they are)
    return {c: c for c in ckpt_keys} | {prefix + c: c for c in ckpt_keys}


def _resolve(
    keys: Sequence[str], view: Mapping[str, str], aliases: Mapping[str, Sequence[str]]
) -> dict[str, str]:
    out = {}
    for key in keys:
        for name in (key, *aliases.get(key, ())):
            if name in view:
                out[key] = view[name]
                break
    return out


def _rule_text(kind: str, prefix: str) -> str:
    if kind == "exact":
        return "exact"
    if kind == "drop":
        return f"checkpoint prefix {prefix!r} dropped"
    return f"model prefix {prefix!r} added to the checkpoint's names"


def match_names(
    model_keys: Sequence[str],
    ckpt_keys: Collection[str],
    aliases: Mapping[str, Sequence[str]] | None = None,
    ignore_unexpected: Iterable[str] = (),
) -> NameMap:
    """Map ``model_keys`` (cleaned names) onto ``ckpt_keys``. ``aliases[k]``: the model names
    tied to ``k`` (any of them may fill it); ``ignore_unexpected``: regular expressions of
    checkpoint names that are never reported (a model's ``_keys_to_ignore_on_load_unexpected``)."""
    aliases = aliases or {}
    best: tuple[int, str, dict[str, str]] | None = None
    for kind, prefix in _rules(model_keys, ckpt_keys):
        found = _resolve(model_keys, _lookup(kind, prefix, ckpt_keys), aliases)
        if best is None or len(found) > best[0]:
            best = (len(found), _rule_text(kind, prefix), found)
    assert best is not None
    _, rule, sources = best
    used = set(sources.values())
    patterns = [re.compile(p) for p in ignore_unexpected]
    unexpected = sorted(
        c for c in ckpt_keys if c not in used and not any(p.search(c) for p in patterns)
    )
    missing = [k for k in model_keys if k not in sources]
    return NameMap(sources, rule, missing, unexpected)


def _some(names: Sequence[str]) -> str:
    shown = ", ".join(names[:EXAMPLES])
    more = len(names) - EXAMPLES
    return shown + (f" and {more} more" if more > 0 else "")


def mismatch_text(
    where: str,
    names: NameMap,
    shapes: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
    strict: bool = True,
) -> str:
    """The error for what does not fit ('' when everything does): missing and (``strict``)
    unexpected names, then shape mismatches (model name, model shape, checkpoint shape)."""
    parts = []
    if names.missing:
        parts.append(
            f"{len(names.missing)} missing (model tensors the checkpoint lacks): "
            f"{_some(names.missing)}"
        )
    if names.unexpected and strict:
        parts.append(
            f"{len(names.unexpected)} unexpected (checkpoint tensors the model lacks): "
            f"{_some(names.unexpected)}"
        )
    if shapes:
        rows = [f"{k} {list(m)} in the model vs {list(c)} in the checkpoint" for k, m, c in shapes]
        parts.append(f"{len(shapes)} with another shape: {_some(rows)}")
    if not parts:
        return ""
    return (
        f"load_pretrained({where}): the checkpoint does not fit the model (names compared: "
        f"{names.rule}): {'; '.join(parts)}. Nothing was read. Load it into the model class and "
        "config it was saved from (its config.json names them), or save it from this model"
        + ("; strict=False ignores unexpected tensors" if names.unexpected and strict else "")
    )
