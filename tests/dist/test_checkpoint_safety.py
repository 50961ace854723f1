"""A crafted checkpoint in a real run: 2 Gloo ranks under ZeRO-3 save a checkpoint, whose
``.metadata`` is then replaced by a pickle that writes a marker file when unpickled, and whose
manifest and COMPLETE marker are re-hashed (every checksum matches). A run with
``checkpoint.resume`` naming it stops on every rank with the reason; a run with
``checkpoint.resume=auto`` skips it with a warning and starts at step 0; a run with
``checkpoint.init_from`` naming it stops. The marker never appears: nothing was unpickled
outside the restricted reader (tests/unit/test_safe_metadata.py shows plain DCP runs it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import meshrun
from _dist import run_distributed
from meshrun.checkpoint import on_disk


class Pairs(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        return {"x": x, "y": x[:2] * 2}


class WritesMarker:
    def __init__(self, marker: Path) -> None:
        self.code = f"open({str(marker)!r}, 'w').write('ran')"

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (self.code,))


def train(
    rank: int, world: int, root: str, resume: str, init_from: str, interval: int = 0
) -> dict[str, Any]:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = f"{root}/run", "cpu", 60.0
    cfg.metrics.progress = False
    cfg.data.global_batch, cfg.data.micro_batch, cfg.optim.steps = 8, 2, 2
    cfg.parallel.zero = 3
    cfg.checkpoint.dir, cfg.checkpoint.interval = f"{root}/ckpt", interval
    cfg.checkpoint.resume, cfg.checkpoint.init_from = resume, init_from
    run = meshrun.init(cfg, argv=[])
    warnings: list[str] = []  # a handler added after init (which sets meshrun's up)
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: warnings.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("meshrun").addHandler(handler)
    torch.manual_seed(0)
    model = run.parallelize(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = run.dataloader(Pairs())
    try:
        start = run.resume(model, opt, loader)
    except Exception as e:  # the refusal: reported, and the run ends cleanly
        run.close()
        return {"error": f"{type(e).__name__}: {e}", "warnings": warnings}
    for batch in run.steps(loader):
        run.backward(F.mse_loss(model(batch["x"]), batch["y"]))
        run.optimizer_step(opt)
    run.close()
    return {"start": start, "warnings": warnings}


def rehash(d: Path) -> None:
    manifest = json.loads((d / on_disk.MANIFEST).read_text())
    manifest["files"][".metadata"] = on_disk.hash_files(d, [".metadata"])[".metadata"]
    blob = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (d / on_disk.MANIFEST).write_bytes(blob)
    (d / on_disk.COMPLETE).write_text(hashlib.sha256(blob).hexdigest())


@pytest.mark.timeout(300)
def test_resume_and_init_from_refuse_a_crafted_metadata(tmp_path: Path) -> None:
    root = str(tmp_path)
    run_distributed(train, 2, root, "never", "", 2, timeout=120)
    step = on_disk.step_dir(tmp_path / "ckpt", 2)
    marker = tmp_path / "marker"
    (step / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    rehash(step)
    assert on_disk.problems(step, checksums=True) != []  # crafted, yet every checksum matches
    named = run_distributed(train, 2, root, str(step), "", timeout=120)
    for r in named:
        assert "CheckpointError" in r["error"] and "refers to builtins.exec" in r["error"], r
    auto = run_distributed(train, 2, root, "auto", "", timeout=120)  # saves nothing
    assert [r["start"] for r in auto] == [0, 0]  # skipped: a fresh start
    assert any("skipping checkpoint" in w and "builtins.exec" in w for w in auto[0]["warnings"])
    fresh = f"{root}/fresh"
    init = run_distributed(train, 2, fresh, "never", str(step), timeout=120)
    for r in init:
        assert "CheckpointError" in r["error"] and "refers to builtins.exec" in r["error"], r
    assert not marker.exists()
