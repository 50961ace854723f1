"""``meshrun bench data``: the loader benchmark mounted under ``meshrun bench`` reads a prepared
dataset in 2 processes at once and reports samples/s per rank; bad flags and directories fail
before any process starts; the old spelling ``meshrun data bench`` is gone (one way only)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.demo.corpus import prepare_demo_tokens

pytestmark = pytest.mark.timeout(180)


def meshrun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "MESHRUN_CONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "meshrun", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )


def test_bench_data_reports_samples_per_rank(tmp_path: Path) -> None:
    tokens = prepare_demo_tokens(tmp_path / "cache", 300_000)
    out = meshrun(
        "bench",
        "data",
        str(tokens),
        "--seq-len",
        "64",
        "--micro-batch",
        "4",
        "--nproc-per-node",
        "2",
        "--batches",
        "20",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    print(out.stdout)
    assert "seq_len 64, micro-batch 4, 0 workers per rank, 2 ranks" in out.stdout
    rates = {
        int(m[1]): (float(m[2]), float(m[3]))
        for m in re.finditer(r"rank (\d+):\s+([\d.]+) samples/s\s+([\d.]+) tokens/s", out.stdout)
    }
    assert sorted(rates) == [0, 1]
    for samples, toks in rates.values():
        assert samples > 0 and toks == pytest.approx(samples * 64, rel=0.01)


def test_bench_data_errors_before_spawning(tmp_path: Path) -> None:
    missing = meshrun("bench", "data", str(tmp_path / "nothing"), cwd=tmp_path)
    assert missing.returncode == 2
    assert "meshrun bench data: error:" in missing.stderr
    assert "manifest.json does not exist" in missing.stderr
    assert "meshrun data prepare" in missing.stderr  # says how to make one
    flags = meshrun("bench", "data", str(tmp_path), "--batches", "0", "--nproc", "0", cwd=tmp_path)
    assert flags.returncode == 2
    assert "--batches 0: must be >= 1" in flags.stderr
    assert "--nproc-per-node 0: must be >= 1" in flags.stderr


def test_data_bench_is_not_a_second_spelling(tmp_path: Path) -> None:
    old = meshrun("data", "bench", str(tmp_path), cwd=tmp_path)
    assert old.returncode == 2
    assert "invalid choice: 'bench'" in old.stderr
