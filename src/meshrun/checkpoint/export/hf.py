"""``meshrun ckpt export PATH OUT_DIR --hf``: a checkpoint as a Hugging Face model directory.

OUT_DIR gets what ``save_pretrained`` writes and ``from_pretrained`` reads: ``config.json``
(saved with the checkpoint, ``hf_files.py``), ``generation_config.json`` if the model had one,
and the weights as ``model.safetensors`` or, above the shard size, as
``model-00001-of-0000N.safetensors`` shards with ``model.safetensors.index.json`` (``weight_map``
and ``metadata.total_size``). Tensors are streamed shard by shard (``export.write_safetensors``:
anonymous memory bounded by ``max_bytes``), floating-point ones converted to ``dtype``.

Names are the model's own: the class in ``config.json``'s ``architectures`` is built on the meta
device (no memory, no weights) and its ``state_dict`` names are the ones written; a checkpoint
name it does not know, or one of its names the checkpoint lacks, stops the export with both
lists. Tied parameters (``lm_head`` tied to the embedding) are written once, under the name
``named_parameters()`` gives first, as ``save_pretrained`` does; ``from_pretrained`` ties the
other back (measured here for a tied Llama and GPT-2).

A pipeline-parallel checkpoint needs no mapping: its stages keep the unsplit model's FQNs, so
it holds the model's own names (each stage wrote its part; a tied embedding and head, one
tensor per stage, are both there and equal: the head is skipped as above), and its
``config.json`` comes from the class and configs the split kept (``hf_files.py``).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshrun.checkpoint.export.dcp import TensorInfo, tensor_table, write_safetensors
from meshrun.checkpoint.hf_files import CONFIG, GENERATION_CONFIG

__all__ = ["HFExport", "export_hf", "parse_size"]

log = logging.getLogger("meshrun")
INDEX = "model.safetensors.index.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Modules torch's wrappers insert (torch.compile, activation checkpointing, FSDP1): never part
# of a transformers name; DCP's get_model_state_dict drops them already, this is the backstop.
_WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20}
_UNITS["GIB"] = 2**30


@dataclass(frozen=True)
class HFExport:
    """What :func:`export_hf` wrote."""

    files: list[str]  # the weight files, in order
    tensors: int
    total_size: int  # tensor bytes (the index's metadata.total_size)
    tied: list[str]  # names not written: tied to one that is


def parse_size(text: str) -> int:
    """``"5GB"`` (10^9, as transformers' ``max_shard_size``), ``"512MiB"``, ``"1000"``: bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(
            f"--shard-size {text!r}: give a positive size such as 5GB, 500MB, 2GiB or a number "
            f"of bytes (units: {', '.join(u for u in _UNITS if u)})"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def export_hf(
    path: Path,
    out_dir: Path,
    *,
    shard_bytes: int = 5 * 10**9,
    dtype: torch.dtype | None = None,
    prefix: str = "model.",
    max_bytes: int = 256 << 20,
) -> HFExport:
    """Write the checkpoint ``path`` as a Hugging Face model directory ``out_dir``."""
    config = _read_config(path)
    _check_out_dir(out_dir)
    infos = [i for i in tensor_table(path) if i.name.startswith(prefix)]
    by_name = {_clean(i.name[len(prefix) :]): i for i in infos}
    order, tied = _model_names(config, path)
    if order is None:  # not a transformers class: every tensor, under the checkpoint's names
        order = list(by_name)
    _check_names(path, config, by_name, order, tied)
    shards = _shards(order, by_name, dtype, shard_bytes)
    out_dir.mkdir(parents=True, exist_ok=True)
    files, weight_map, total = _write_shards(path, out_dir, shards, by_name, dtype, max_bytes)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if dtype is not None:  # what from_pretrained(dtype="auto") reads
        config["dtype"] = _DTYPE_NAMES[dtype]
    (out_dir / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (path / GENERATION_CONFIG).exists():
        (out_dir / GENERATION_CONFIG).write_text((path / GENERATION_CONFIG).read_text())
    return HFExport(files, len(order), total, sorted(tied & set(by_name)))


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((path / CONFIG).read_text()))
    except FileNotFoundError:
        raise ValueError(
            f"--hf: {path} has no {CONFIG}: a checkpoint keeps one only when the model it "
            "saved is a transformers model (a PreTrainedModel, e.g. LlamaForCausalLM, given to "
            "run.parallelize, run.pipeline or run.resume; checkpoints written before pipeline "
            "checkpoints kept it have none). Export without --hf (OUT.safetensors or OUT.pt: "
            "the weights alone), or save the checkpoint from a transformers model"
        ) from None


# What from_pretrained could read as weights: an old file of these beside the new ones would be
# loaded with them (or instead of them), so an OUT_DIR holding one is refused.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def _check_out_dir(out_dir: Path) -> None:
    """OUT_DIR may be new, empty, or hold what the export does not write (a tokenizer saved
    there first, a README): only weight files and their indexes are refused. config.json and
    generation_config.json are replaced by the checkpoint's own, and the export says so."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--hf: {out_dir} exists and is not a directory; name a directory")
    if not out_dir.is_dir():
        return
    names = sorted(p.name for p in out_dir.iterdir() if p.is_file())
    weights = [n for n in names if n.endswith(_WEIGHT_SUFFIXES) or n.endswith(".index.json")]
    if weights:
        raise ValueError(
            f"--hf: {out_dir} exists and is not an empty directory: it holds weight files "
            f"{_few(weights)}, which from_pretrained would load with the new ones; name a new "
            "directory or remove them (tokenizer and other non-weight files may stay)"
        )
    replaced = [n for n in names if n in (CONFIG, GENERATION_CONFIG)]
    if replaced:
        log.warning("--hf: %s: replacing %s with the checkpoint's own", out_dir, replaced)


def _clean(name: str) -> str:
    return ".".join(s for s in name.split(".") if s not in _WRAPPER_SEGMENTS)


def _model_names(config: dict[str, Any], path: Path) -> tuple[list[str] | None, set[str]]:
    """The state_dict names of the model class in ``config`` (built on the meta device) and
    those of them tied to an earlier one; ``(None, set())`` for a class transformers lacks."""
    import transformers  # the hf extra; --hf needs it

    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        log.warning(
            "%s: %s names architectures=%s, not a transformers class: exporting every tensor "
            "under the checkpoint's names, tied weights not merged",
            path,
            CONFIG,
            config.get("architectures"),
        )
        return None, set()
    with torch.device("meta"):
        model = cls(cls.config_class.from_dict(config))
    every = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    tied = set(every) - {n for n, _ in model.named_parameters()}
    return [n for n in model.state_dict() if n not in tied], tied


def _check_names(
    path: Path,
    config: dict[str, Any],
    by_name: dict[str, TensorInfo],
    order: list[str],
    tied: set[str],
) -> None:
    missing = [n for n in order if n not in by_name]
    unexpected = sorted(set(by_name) - set(order) - tied)
    if not (missing or unexpected):
        return
    arch = (config.get("architectures") or ["?"])[0]
    raise ValueError(
        f"--hf: the tensors of {path} do not match {arch}'s names: missing {_few(missing)}, "
        f"unexpected {_few(unexpected)} (see `meshrun ckpt inspect {path}`); was this "
        f"checkpoint saved from the {arch} its {CONFIG} describes?"
    )


def _few(names: list[str]) -> str:
    return f"{names[:8]}{f' and {len(names) - 8} more' if len(names) > 8 else ''}"


def _shards(
    order: list[str], by_name: dict[str, TensorInfo], dtype: torch.dtype | None, limit: int
) -> list[list[str]]:
    """Consecutive names in groups of at most ``limit`` bytes (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in order:
        nbytes = _out_bytes(by_name[name], dtype)
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _out_bytes(info: TensorInfo, dtype: torch.dtype | None) -> int:
    return info.nbytes_as(
        dtype if dtype is not None and info.dtype.is_floating_point else info.dtype
    )


def _write_shards(
    path: Path,
    out_dir: Path,
    shards: list[list[str]],
    by_name: dict[str, TensorInfo],
    dtype: torch.dtype | None,
    max_bytes: int,
) -> tuple[list[str], dict[str, str], int]:
    n = len(shards)
    files, weight_map, total = [], {}, 0
    for k, names in enumerate(shards, start=1):
        fname = "model.safetensors" if n == 1 else f"model-{k:05d}-of-{n:05d}.safetensors"
        infos = [by_name[name] for name in names]
        total += write_safetensors(
            path, out_dir / fname, infos, names, max_bytes=max_bytes, dtype=dtype
        )
        files.append(fname)
        weight_map.update(dict.fromkeys(names, fname))
    return files, weight_map, total
