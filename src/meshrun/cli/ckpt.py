"""``meshrun ckpt list|inspect|verify|export``: look at checkpoints without starting a job."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshrun.checkpoint import on_disk
from meshrun.runtime.logs import say_error

__all__ = ["add_parser"]

_DTYPE_CHOICES = ("bf16", "fp16", "fp32")  # export_hf.DTYPES' keys (torch: not imported here)


def _dir_size(path: Path) -> int:
    # lstat: a symlink counts as itself, never as a file it points to (outside, perhaps)
    return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir() or p.is_symlink())


def _targets(path: Path) -> list[Path]:
    """A checkpoint directory itself, or every checkpoint under a root."""
    if (path / on_disk.MANIFEST).exists() or (path / on_disk.COMPLETE).exists():
        return [path]
    return [c.path for c in on_disk.list_checkpoints(path)]


def cmd_list(a: argparse.Namespace) -> int:
    root = Path(a.dir)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        say_error(
            "ckpt list",
            f"{root} {what}; give a run's checkpoint directory, e.g. runs/NAME/checkpoints",
        )
        return 2
    found = on_disk.list_checkpoints(root)
    pending = sorted(p.name for p in root.glob("step_*.tmp")) if root.is_dir() else []
    if not found and not pending:
        print(f"no checkpoints under {root}")
        return 0
    print(f"{'step':>10}  {'size':>10}  status")
    for c in found:
        bad = on_disk.problems(c.path, checksums=a.checksums)
        status = "valid" if not bad else "INVALID: " + "; ".join(bad)
        print(f"{c.step:>10}  {_dir_size(c.path) / 1e6:>8.1f}MB  {status}")
    for name in pending:
        print(f"{name:>10}  {'':>10}  unfinished save (ignored; removed by the next save of it)")
    return 0


def cmd_inspect(a: argparse.Namespace) -> int:
    path = Path(a.path)
    # Sizes, paths and DCP's metadata (through the restricted unpickler) before anything is
    # read from it: a crafted checkpoint is named here, never loaded.
    # The checksums too, unless asked not to: a bit flipped in a data file is named here.
    bad = on_disk.problems(path, checksums=not a.no_checksums)
    if bad:
        say_error("ckpt inspect", f"{path} is not a valid checkpoint: {'; '.join(bad)}", sys.stdout)
        return 2
    manifest = on_disk.read_manifest(path)
    meta = {k: v for k, v in manifest.items() if k != "files"}
    print(json.dumps(meta, indent=1, sort_keys=True))
    print(
        f"files: {len(manifest['files'])}, {sum(f['size'] for f in manifest['files'].values()) / 1e6:.1f} MB"
    )
    if a.config:
        print(json.loads((path / "state.json").read_text())["config_toml"])
    from meshrun.checkpoint.export.dcp import tensor_table  # torch: only when needed

    for info in tensor_table(path):
        print(f"  {info.name:<60} {str(info.dtype).removeprefix('torch.'):<9} {list(info.shape)}")
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    targets = _targets(Path(a.path))
    if not targets:
        print(f"no checkpoints under {a.path}")
        return 1
    failed = 0
    for path in targets:
        bad = on_disk.problems(path, checksums=True)
        failed += bool(bad)
        print(f"{path}: " + ("OK (all checksums match)" if not bad else "INVALID"))
        for why in bad:
            print(f"  {why}")
    return 1 if failed else 0


def cmd_export(a: argparse.Namespace) -> int:
    path = Path(a.path)
    bad = on_disk.problems(path)
    if bad:
        print(f"{path} is not a valid checkpoint: {'; '.join(bad)}")
        return 1
    try:
        return _export_hf(a, path) if a.hf else _export_file(a, path)
    except ValueError as e:
        say_error("ckpt export", e, sys.stdout)
        return 2
    except (EOFError, OSError, RuntimeError) as e:  # a data file that is not what its table says
        say_error(
            "ckpt export", f"{path}: its data cannot be read ({type(e).__name__}: {e})", sys.stdout
        )
        return 2


def _export_file(a: argparse.Namespace, path: Path) -> int:
    from meshrun.checkpoint.export.dcp import DTYPES, export  # torch: only when needed

    dtype = DTYPES[a.dtype] if a.dtype else None
    infos = export(path, Path(a.out), prefix=a.prefix, max_bytes=a.max_mb << 20, dtype=dtype)
    total = sum(i.nbytes_as(dtype or i.dtype) for i in infos)
    print(f"wrote {a.out}: {len(infos)} tensors, {total / 1e6:.1f} MB")
    return 0


def _export_hf(a: argparse.Namespace, path: Path) -> int:
    from meshrun.checkpoint.export.dcp import DTYPES
    from meshrun.checkpoint.export.hf import export_hf, parse_size

    done = export_hf(
        path,
        Path(a.out),
        shard_bytes=parse_size(a.shard_size),
        dtype=DTYPES[a.dtype] if a.dtype else None,
        prefix=a.prefix,
        max_bytes=a.max_mb << 20,
    )
    tied = f"; tied, written once: {', '.join(done.tied)}" if done.tied else ""
    print(
        f"wrote {a.out}: {done.tensors} tensors, {done.total_size / 1e6:.1f} MB in "
        f"{len(done.files)} file(s){tied}; load it with from_pretrained({str(a.out)!r})"
    )
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ckpt", help="list, inspect, verify and export checkpoints")
    csub = p.add_subparsers(dest="ckpt_cmd", required=True)
    ls = csub.add_parser("list", help="checkpoints under DIR: step, size, valid or why not")
    ls.add_argument("dir", help="checkpoint root (e.g. runs/demo/checkpoints)")
    ls.add_argument("--checksums", action="store_true", help="also recompute every checksum")
    ls.set_defaults(fn=cmd_list)
    ins = csub.add_parser("inspect", help="manifest, layout and tensor table of one checkpoint")
    ins.add_argument("path", help="a checkpoint directory (step_NNNNNNNN)")
    ins.add_argument("--config", action="store_true", help="also print the run's resolved config")
    ins.add_argument(
        "--no-checksums",
        action="store_true",
        help="skip recomputing the data files' checksums (sizes and metadata are still checked)",
    )
    ins.set_defaults(fn=cmd_inspect)
    ver = csub.add_parser("verify", help="recompute checksums; exit 1 if any checkpoint is invalid")
    ver.add_argument("path", help="a checkpoint directory, or a root holding several")
    ver.set_defaults(fn=cmd_verify)
    exp = csub.add_parser(
        "export", help="consolidate into one .safetensors or .pt file, or (--hf) an HF directory"
    )
    exp.add_argument("path", help="a checkpoint directory")
    exp.add_argument(
        "out",
        help="NAME.safetensors (streamed) or NAME.pt; with --hf a directory holding no weight "
        "files (a tokenizer may be there)",
    )
    exp.add_argument(
        "--hf",
        action="store_true",
        help="write a Hugging Face directory (config.json, sharded safetensors, index) that "
        "from_pretrained loads; needs a checkpoint of a transformers model",
    )
    exp.add_argument(
        "--shard-size", default="5GB", help="with --hf: largest weight file (default: 5GB)"
    )
    exp.add_argument(
        "--dtype",
        choices=sorted(_DTYPE_CHOICES),
        help="convert floating-point tensors (default: as saved)",
    )
    exp.add_argument("--prefix", default="model.", help="tensors to export (default: model.)")
    exp.add_argument("--max-mb", type=int, default=256, help="memory bound while streaming")
    exp.set_defaults(fn=cmd_export)
