"""Read a sharded checkpoint in one process: its tensor table, and an export to one file.

``export`` consolidates the model weights (by default) into a ``.safetensors`` file or into a
``.pt`` file (``torch.save``: the whole model in memory; load it with ``weights_only=True``).
Every safetensors file is written by the ``safetensors`` library (``save_file``); the
Hugging Face directory export (``checkpoint/export/hf.py``) writes its shards with the same
:func:`write_safetensors`.

Memory: ``save_file`` takes the whole file's tensors at once, so they are staged in a
file-backed shared mapping (``torch.from_file``) next to the output, filled from
the checkpoint in groups of at most ``max_bytes``. The process's own (anonymous) memory stays
bounded by ``max_bytes`` however big the file; the staged pages are page cache the kernel can
write back and drop, and the staging file is removed once the output is written.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshrun.checkpoint import safe_metadata

__all__ = ["DTYPES", "TensorInfo", "export", "tensor_table", "write_safetensors"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype
_ALIGN = 64  # each staged tensor starts on a 64-byte boundary (any dtype's alignment)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.nbytes_as(self.dtype)

    def nbytes_as(self, dtype: torch.dtype) -> int:
        n = dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def tensor_table(path: Path) -> list[TensorInfo]:
    """Every tensor of the checkpoint (global shapes, whatever the sharding), from DCP's
    metadata."""
    meta = safe_metadata.read_metadata(path)  # DCP's pickle, through the restricted unpickler
    return [
        TensorInfo(name, m.properties.dtype, tuple(m.size))
        for name, m in sorted(meta.state_dict_metadata.items())
        if isinstance(m, TensorStorageMetadata)
    ]


def _load_chunks(
    path: Path, infos: Sequence[TensorInfo], max_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Load the tensors in groups of at most ``max_bytes`` (one tensor if it alone is bigger)."""
    group: list[TensorInfo] = []
    for info in [*infos, None]:
        full = info is None or (group and sum(i.nbytes for i in group) + info.nbytes > max_bytes)
        if full and group:
            sd = {i.name: torch.empty(i.shape, dtype=i.dtype) for i in group}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                safe_metadata.load(sd, path)
            yield sd
            group = []
        if info is not None:
            group.append(info)


def export(
    path: Path,
    out: Path,
    *,
    prefix: str = "model.",
    max_bytes: int = 256 << 20,
    dtype: torch.dtype | None = None,
) -> list[TensorInfo]:
    """Write the tensors whose names start with ``prefix`` (stripped) to ``out``, floating-point
    ones converted to ``dtype`` if given."""
    infos = [i for i in tensor_table(path) if i.name.startswith(prefix)]
    if not infos:
        raise ValueError(f"{path}: no tensors named {prefix!r}*; see `meshrun ckpt inspect`")
    if out.suffix == ".safetensors":
        names = [i.name[len(prefix) :] for i in infos]
        write_safetensors(path, out, infos, names, max_bytes=max_bytes, dtype=dtype)
    elif out.suffix in (".pt", ".pth"):
        sd: dict[str, torch.Tensor] = {}
        infos_of = {i.name: i for i in infos}
        for chunk in _load_chunks(path, infos, max_bytes):
            sd.update(
                {
                    k[len(prefix) :]: v.to(_target_dtype(infos_of[k], dtype))
                    for k, v in chunk.items()
                }
            )
        torch.save(sd, out)
    else:
        raise ValueError(f"export to {out}: the name must end in .safetensors or .pt")
    return infos


def write_safetensors(
    path: Path,
    out: Path,
    infos: Sequence[TensorInfo],
    names: Sequence[str],
    *,
    max_bytes: int,
    dtype: torch.dtype | None = None,
) -> int:
    """Write the checkpoint's tensors ``infos`` under ``names`` to the safetensors file ``out``
    (floating-point tensors converted to ``dtype`` if given); returns the tensor bytes written."""
    from safetensors.torch import save_file  # a runtime dependency; imported when exporting

    targets = [_target_dtype(i, dtype) for i in infos]
    offsets, total = _layout(infos, targets)
    staging = out.with_name(f".{out.name}.staging")
    try:
        flat = torch.from_file(str(staging), shared=True, size=max(total, 1), dtype=torch.uint8)
        views = {
            i.name: flat[o : o + i.nbytes_as(t)].view(t).view(i.shape)
            for i, t, o in zip(infos, targets, offsets, strict=True)
        }
        for chunk in _load_chunks(path, infos, max_bytes):
            for name, tensor in chunk.items():
                views[name].copy_(tensor)  # converts the dtype where asked
        save_file(
            {n: views[i.name] for n, i in zip(names, infos, strict=True)},
            str(out),
            metadata={"format": "pt"},  # what transformers' save_pretrained writes
        )
        del views, flat  # unmaps the staging file
        out.chmod(0o666 & ~_umask())  # save_file creates it 0600; other files follow the umask
    finally:
        staging.unlink(missing_ok=True)
    return sum(i.nbytes_as(t) for i, t in zip(infos, targets, strict=True))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _target_dtype(info: TensorInfo, dtype: torch.dtype | None) -> torch.dtype:
    """Floating-point tensors take ``dtype``; integer and bool tensors keep theirs."""
    return dtype if dtype is not None and info.dtype.is_floating_point else info.dtype


def _layout(infos: Sequence[TensorInfo], dtypes: Sequence[torch.dtype]) -> tuple[list[int], int]:
    """Byte offsets of the staged tensors in one buffer, and its size."""
    offsets, at = [], 0
    for info, dt in zip(infos, dtypes, strict=True):
        offsets.append(at)
        at += -(-info.nbytes_as(dt) // _ALIGN) * _ALIGN
    return offsets, at
