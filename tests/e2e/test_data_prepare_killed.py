"""``meshrun data prepare`` killed (SIGKILL) midway and rerun gives byte-identical shards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshrun.data.shards import verify_dataset

SCRIPT = Path(__file__).parent / "scripts" / "slow_prepare.py"
MESHRUN = [sys.executable, "-m", "meshrun"]


def corpus(root: Path, files: int = 60) -> None:
    root.mkdir()
    for i in range(files):
        (root / f"doc{i:03d}.txt").write_text(f"line {i} of a document\n" * (20 + 7 * i))


def cli_prepare(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [*MESHRUN, "data", "prepare", str(source), "--out", str(out), "--shard-tokens", "5000"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.mark.timeout(240)
def test_killed_prepare_resumes_to_identical_shards(tmp_path: Path) -> None:
    source = tmp_path / "in"
    corpus(source)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(source), str(out)], start_new_session=True
    )
    work = out / ".prepare"
    deadline = time.monotonic() + 120
    while len(list(work.glob("unit_*.npy"))) < 10 and time.monotonic() < deadline:
        assert proc.poll() is None, "prepare finished before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the workers too: nothing gets to clean up
    proc.wait(timeout=30)
    done = len(list(work.glob("unit_*.npy")))
    assert 10 <= done < 60 and not (out / "manifest.json").exists()

    # The rerun goes through the script too: its units (one per file) must match the killed
    # run's for the finished unit files to be reused.
    rerun = subprocess.run(
        [sys.executable, str(SCRIPT), str(source), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming" in rerun.stderr

    ref = tmp_path / "ref"
    fresh = cli_prepare(source, ref)
    assert fresh.returncode == 0, fresh.stderr
    assert files(out) == files(ref) and len(files(ref)) > 3
    assert verify_dataset(out) == []
