"""Before step 1: run.parallelize refuses a meta-built model whose traced peak is over the
configured memory (train/fit.py), on every rank, naming the figures and the layouts that fit;
a layout that fits goes through, and its check's cost is measured."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tests._dist import run_distributed

import meshrun
from meshrun.config import ConfigError
from meshrun.demo.model import GPT, GPTConfig
from meshrun.train.fit import check_fit

pytestmark = pytest.mark.timeout(240)


def _meta_gpt() -> torch.nn.Module:
    with torch.device("meta"):
        return GPT(GPTConfig(seq_len=128, n_layer=2, n_head=2, d_model=64))


def _rank(rank: int, world_size: int, tmp: Path) -> dict[str, Any]:
    cfg = meshrun.Config()
    cfg.job.run_dir, cfg.job.device, cfg.job.timeout_s = str(tmp / "run"), "cpu", 60.0
    cfg.data.global_batch, cfg.data.micro_batch = 16, 8
    cfg.metrics.progress = False
    run = meshrun.init(cfg, argv=[])
    run.config.parallel.memory_limit_gb = 1.0  # fits: the check runs and lets it through
    start = time.perf_counter()
    check_fit(_meta_gpt(), run.mesh, run.config, run.device)
    fits_s = time.perf_counter() - start
    run.config.parallel.memory_limit_gb = 0.012  # DDP at micro-batch 8 needs ~0.017 GB
    try:
        run.parallelize(_meta_gpt())
        message = ""
    except ConfigError as e:
        message = str(e)
    run.close()
    return {"message": message, "fits_s": fits_s}


def test_a_layout_over_the_limit_is_refused_before_step_1(tmp_path: Path) -> None:
    out = run_distributed(_rank, 2, tmp_path, timeout=200)
    for r in out:
        text = r["message"]
        assert "dp_shard=2,zero=0,micro_batch=8" in text, text
        assert "parallel.memory_limit_gb = 0.012 GB" in text
        assert "layouts that fit:" in text and "activation_checkpoint=1" in text
        assert "micro_batch=4" in text
    print("check when it fits, s per rank:", [round(r["fits_s"], 2) for r in out])
