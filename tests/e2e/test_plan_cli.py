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
    args = [
        "--layers",
        "80",
        "--hidden",
        "8192",
        "--heads",
        "64",
        "--kv-heads",
        "8",
        "--ffn",
        "28672",
        "--mlp",
        "gated",
        "--vocab",
        "128256",
        "--seq",
        "4096",
        "--nodes",
        "128",
        "--gpu",
        "h100-sxm",
        "--global-batch",
        "1024",
        "--json",
        "--top",
        "3",
    ]
    env = {k: v for k, v in os.environ.items() if k != "MESHRUN_CONFIG"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "meshrun", "plan", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
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


def run_plan(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # No PYTHONPATH: a model file is found by its path alone.
    env = {k: v for k, v in os.environ.items() if k not in ("MESHRUN_CONFIG", "PYTHONPATH")}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "meshrun",
            "plan",
            "--gpus-per-node",
            "2",
            "--global-batch",
            "8",
            "--top",
            "1",
            *args,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


# Importing torch and transformers takes 10-60 s on a loaded 2-core machine: a hang guard only.
@pytest.mark.timeout(600)
def test_a_model_file_by_path_with_kwargs_as_a_user_runs_it(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "mlp_mixer.py").write_text(
        "from torch import nn\n"
        "class Block(nn.Module):\n"
        "    def __init__(self, d, h):\n"
        "        super().__init__()\n"
        "        self.attn = nn.MultiheadAttention(d, h)\n"
        "        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)\n"
        "def make(depth, width=64, heads=4):\n"
        "    net = nn.Module()\n"
        "    net.tok = nn.Embedding(1000, width)\n"
        "    net.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))\n"
        "    return net\n"
    )
    proc = run_plan(
        tmp_path,
        "--model",
        "models/mlp_mixer.py:make",
        "--model-kwargs",
        '{"depth": 3}',
        "--seq",
        "32",
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # 64,000 embedding + 3 blocks x (in_proj 12,480 + out_proj 4,160 + fc 16,640 + proj 16,448)
    assert "model models/mlp_mixer.py:make: Module, 213K parameters (213,184;" in out
    assert "layers   3        blocks (3 x Block)" in out
    assert "heads    4        blocks.0.attn.num_heads" in out
    assert "213K parameters on 2 GPUs" in out
    bad = run_plan(tmp_path, "--model", "models/mlp_mixer.py:make")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith(
        "meshrun plan: error: --model 'models/mlp_mixer.py:make': "
        "make(depth, width=64, heads=4) cannot be called"
    )


@pytest.mark.timeout(600)
def test_a_hugging_face_config_directory_as_a_user_runs_it(tmp_path: Path) -> None:
    from transformers import Qwen2Config

    Qwen2Config(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    ).save_pretrained(tmp_path / "qwen")
    proc = run_plan(tmp_path, "--model", "qwen", "--seq", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    model = json.loads(proc.stdout)["model"]
    assert model["class"] == "Qwen2ForCausalLM" and model["built_from"] == "config.json"
    assert {k: model["shape"][k] for k in ("layers", "heads", "kv_heads", "ffn", "mlp")} == {
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "ffn": 128,
        "mlp": "gated",
    }
    assert "kv-heads 2        config.num_key_value_heads" in proc.stderr


def test_plan_without_a_model_imports_neither_torch_nor_transformers(tmp_path: Path) -> None:
    code = (
        "import sys\nfrom meshrun.cli.main import main\n"
        "assert main(['plan', '--params', '7e9', '--top', '1']) == 0\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"
