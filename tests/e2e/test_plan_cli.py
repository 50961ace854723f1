"""``meshrun plan`` as a user runs it: a subprocess, a 1,024-GPU cluster, JSON out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_plan_for_1024_gpus_as_a_subprocess(tmp_path: Path) -> None:
    args = ["--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "8",
            "--ffn", "28672", "--mlp", "gated", "--vocab", "128256", "--seq", "4096", "--nodes", "128",
            "--gpu", "h100-sxm", "--global-batch", "1024", "--json", "--top", "3"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MESHRUN_CONFIG"}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "meshrun", "plan", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=90)  # fmt: skip
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    print(
        f"70B-shaped model on 1024 H100: search {doc['search_s']:.2f} s, "
        f"{doc['evaluated']} layouts, whole command {wall:.1f} s (mostly importing torch)"
    )
    # Llama-3-70B's shape (it has 70.6B with an untied output layer; the GPT formula ties it).
    assert doc["params"] == pytest.approx(69.5e9, rel=0.01)
    best = doc["layouts"][0]
    assert best["fits"] and best["memory_gb"]["total"] <= 80
    assert best["tp"] <= 8  # tensor parallelism stays inside a node
    assert 0.05 < best["mfu"] < 0.5
