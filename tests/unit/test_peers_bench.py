"""benchmarks/peers.py without the peers: its flags, its skip line, its variant matrix.

The peers themselves (Accelerate, Fabric, DeepSpeed) are bench-only extras that CI does not
install; the benchmark's results are in docs/parallel.md."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import scripts

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peers.py"


def load_peers() -> ModuleType:
    return scripts.load(SCRIPT, "_peers_bench")


def test_help_runs_without_torch_imports() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "--frameworks" in out.stdout and "--repeats" in out.stdout


def test_missing_peer_is_skipped_with_a_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    peers = load_peers()
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "deepspeed" else real(name)
    )
    assert peers.installed(["meshrun", "deepspeed"]) == ["meshrun"]
    assert "skipped: deepspeed is not installed" in capsys.readouterr().out


def test_variants_pair_each_stage_with_the_peers_that_have_it() -> None:
    peers = load_peers()
    keys = peers.variants(["meshrun", "accelerate", "deepspeed"], [0, 1, 3])
    assert keys == [
        (0, "meshrun"),
        (0, "accelerate"),
        (0, "deepspeed"),
        (1, "meshrun"),
        (1, "deepspeed"),  # Accelerate has no ZeRO-1 of its own
        (3, "meshrun"),
        (3, "accelerate"),
        (3, "deepspeed"),
    ]
