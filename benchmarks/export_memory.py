"""Peak memory of `meshrun ckpt export` on a checkpoint of about 200 MB (fp32).

    .venv/bin/python benchmarks/export_memory.py [--mb 218] [--max-mb 32] [--hf-shard 64MB]

Writes a DCP checkpoint of 32 matrices of 6 MB and one of 16 MB (one process, no process
group), then runs each export in a fresh process and prints, above that process's baseline
(after its imports), sampled every 2 ms by a thread from /proc/self/status: the peak resident
set (VmRSS), its anonymous part (RssAnon: the process's own heap), its mapped file pages
(RssFile) and shared memory (RssShmem: a tmpfs output directory). The export stages each
output file in a file-backed mapping and fills it in groups of at most --max-mb
(docs/checkpoint.md, "Memory"): RssAnon should stay near --max-mb (plus DCP's read buffers),
RssFile near the largest output file.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

CHILD = r"""
import sys, threading, time
from pathlib import Path
from meshrun.checkpoint import export, export_hf  # imported before the baseline
import safetensors.torch

KEYS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
peak, now = dict.fromkeys(KEYS, 0), dict.fromkeys(KEYS, 0)
def sample():
    while True:
        for line in open("/proc/self/status"):
            key = line.split(":")[0]
            if key in KEYS:
                now[key] = int(line.split()[1])
                peak[key] = max(peak[key], now[key])
        time.sleep(0.002)

threading.Thread(target=sample, daemon=True).start()
time.sleep(0.1)
base = dict(now)
ckpt, out, max_mb, shard = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if shard == "-":
    export.export(ckpt, out, max_bytes=max_mb << 20)
else:
    infos = export.tensor_table(ckpt)
    names = [i.name for i in infos]
    # plain tensors, no config: the streaming part of --hf (shards of the chosen size)
    groups = export_hf._shards(names, {i.name: i for i in infos}, None, export_hf.parse_size(shard))
    out.mkdir()
    for k, g in enumerate(groups):
        sel = [i for i in infos if i.name in set(g)]
        export.write_safetensors(ckpt, out / f"{k}.safetensors", sel, g, max_bytes=max_mb << 20)
time.sleep(0.1)
print(", ".join(f"{k} +{(peak[k] - base[k]) / 1024:.0f} MB" for k in KEYS))
"""


def make_checkpoint(path: Path, mb: int) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    n = max(1, (mb - 16) // 6)
    sd = {f"model.layers.{i}.w": torch.randn(1024, 1536) for i in range(n)}
    sd["model.embed.weight"] = torch.randn(4096, 1024)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=str(path))
    return sum(t.nbytes for t in sd.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=218)
    p.add_argument("--max-mb", type=int, default=32)
    p.add_argument("--hf-shard", default="64MB")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        total = make_checkpoint(ckpt, a.mb)
        print(f"checkpoint: {total / 1e6:.0f} MB fp32, --max-mb {a.max_mb}")
        for label, out, shard in (
            ("single file", Path(tmp) / "m.safetensors", "-"),
            (f"shards of {a.hf_shard}", Path(tmp) / "hf", a.hf_shard),
        ):
            args = [str(ckpt), str(out), str(a.max_mb), shard]
            res = subprocess.run(
                [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=True
            )
            print(f"{label:>20}: {res.stdout.strip()}")


if __name__ == "__main__":
    main()
