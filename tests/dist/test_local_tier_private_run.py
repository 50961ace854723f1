"""The node-local snapshots in a real run (one Gloo process, the cheapest): removed when the run
ends well, kept with ``checkpoint.local_keep``, and a snapshot whose bytes changed afterwards is
refused on restore with a message (the run starts from the shared path instead)."""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshrun
from _dist import run_distributed


def make_config(tmp: Path, steps: int, keep: bool) -> meshrun.Config:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = str(tmp / "run"), "cpu", 60.0
    cfg.data.global_batch, cfg.data.micro_batch = 4, 2
    cfg.optim.steps, cfg.metrics.progress = steps, False
    cfg.checkpoint.local_interval, cfg.checkpoint.local_keep = 2, keep
    cfg.checkpoint.local_dir = str(tmp / "local" / "node{node}")
    return cfg


def train(rank: int, world_size: int, cfg: meshrun.Config) -> dict[str, Any]:
    run = meshrun.init(cfg, argv=[])
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: lines.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("meshrun").addHandler(handler)
    torch.manual_seed(0)
    model = run.parallelize(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = run.dataloader(data)
    start = run.resume(model, opt, loader)
    for x, y in run.steps(loader):
        run.backward(F.mse_loss(model(x), y))
        run.optimizer_step(opt)
    run.close()
    return {"start": start, "lines": lines}


def _files(tmp: Path) -> list[Path]:
    return sorted(p for p in (tmp / "local").rglob("*") if p.is_file())


@pytest.mark.timeout(180)
def test_snapshots_go_at_a_good_end_unless_kept_and_a_changed_one_is_refused(
    tmp_path: Path,
) -> None:
    out = run_distributed(train, 1, make_config(tmp_path, 4, keep=False), timeout=120)
    assert _files(tmp_path) == []  # written every 2 steps, removed when the run ended well
    assert any("node-local snapshots removed" in line for line in out[0]["lines"])
    run_distributed(train, 1, make_config(tmp_path / "kept", 4, keep=True), timeout=120)
    files = _files(tmp_path / "kept")
    assert [f.name for f in files] == ["rank_00000.pt", "rank_00000.pt"]  # steps 2 and 4
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    _flip_a_tensor_bit(files[-1])
    again = run_distributed(train, 1, make_config(tmp_path / "kept", 4, keep=True), timeout=120)
    said = " | ".join(again[0]["lines"])
    assert again[0]["start"] == 0, said  # step 4 refused: no shared checkpoint, a fresh start
    assert "not restored on rank 0" in said and "checksum mismatch" in said, said


def _flip_a_tensor_bit(path: Path) -> None:
    """One bit of the first tensor's stored bytes (torch.save writes a zip, uncompressed)."""
    with zipfile.ZipFile(path) as z:
        at = next(i for i in z.infolist() if "/data/" in i.filename).header_offset
    raw = bytearray(path.read_bytes())
    start = at + 30 + int.from_bytes(raw[at + 26 : at + 28], "little")
    start += int.from_bytes(raw[at + 28 : at + 30], "little")
    raw[start] ^= 0x01
    path.write_bytes(bytes(raw))
