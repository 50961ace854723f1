"""Read a sharded checkpoint in one process: its tensor table, and an export to one file.

``export`` consolidates the model weights (by default) into a ``.safetensors`` file, written
tensor by tensor so that memory stays bounded by ``max_bytes`` however big the model, or into
a ``.pt`` file (``torch.save``: the whole model in memory; load it with ``weights_only=True``).
The safetensors format is simple enough to write here (an 8-byte header length, a JSON
header of dtypes, shapes and offsets, then raw little-endian bytes), so it needs no package.
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["TensorInfo", "export", "read_safetensors", "tensor_table"]

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def tensor_table(path: Path) -> list[TensorInfo]:
    """Every tensor of the checkpoint (global shapes, whatever the sharding), from DCP's
    metadata."""
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    return [
        TensorInfo(name, m.properties.dtype, tuple(m.size))
        for name, m in sorted(meta.state_dict_metadata.items())
        if isinstance(m, TensorStorageMetadata)
    ]


def _load_chunks(
    path: Path, infos: list[TensorInfo], max_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Load the tensors in groups of at most ``max_bytes`` (one tensor if it alone is bigger)."""
    group: list[TensorInfo] = []
    for info in [*infos, None]:
        full = info is None or (group and sum(i.nbytes for i in group) + info.nbytes > max_bytes)
        if full and group:
            sd = {i.name: torch.empty(i.shape, dtype=i.dtype) for i in group}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(sd, checkpoint_id=str(path))
            yield sd
            group = []
        if info is not None:
            group.append(info)


def export(
    path: Path, out: Path, *, prefix: str = "model.", max_bytes: int = 256 << 20
) -> list[TensorInfo]:
    """Write the tensors whose names start with ``prefix`` (stripped) to ``out``."""
    infos = [i for i in tensor_table(path) if i.name.startswith(prefix)]
    if not infos:
        raise ValueError(f"{path}: no tensors named {prefix!r}*; see `meshrun ckpt inspect`")
    if out.suffix == ".safetensors":
        _write_safetensors(path, out, infos, prefix, max_bytes)
    elif out.suffix in (".pt", ".pth"):
        sd: dict[str, torch.Tensor] = {}
        for chunk in _load_chunks(path, infos, max_bytes):
            sd.update({k[len(prefix) :]: v for k, v in chunk.items()})
        torch.save(sd, out)
    else:
        raise ValueError(f"export to {out}: the name must end in .safetensors or .pt")
    return infos


def _write_safetensors(
    path: Path, out: Path, infos: list[TensorInfo], prefix: str, max_bytes: int
) -> None:
    header: dict[str, object] = {}
    offset = 0
    for i in infos:
        if i.dtype not in _ST_DTYPES:
            raise ValueError(f"{i.name}: dtype {i.dtype} has no safetensors code; export to .pt")
        header[i.name[len(prefix) :]] = {
            "dtype": _ST_DTYPES[i.dtype],
            "shape": list(i.shape),
            "data_offsets": [offset, offset + i.nbytes],
        }
        offset += i.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(out, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)) + blob)
        for chunk in _load_chunks(path, infos, max_bytes):
            for info in infos:
                if info.name in chunk:
                    fh.write(_raw_bytes(chunk[info.name]))


def _raw_bytes(t: torch.Tensor) -> bytes:
    flat = t.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file (small helper; the `safetensors` package reads it too)."""
    codes = {v: k for k, v in _ST_DTYPES.items()}
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        lo, hi = h["data_offsets"]
        raw = bytearray(data[base + lo : base + hi])
        dtype = codes[h["dtype"]]
        out[name] = (
            torch.frombuffer(raw, dtype=dtype).reshape(h["shape"])
            if raw
            else torch.empty(h["shape"], dtype=dtype)
        )
    return out
