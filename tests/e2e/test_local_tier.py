"""The node-local checkpoint tier through ``meshrun launch`` and torchrun's restarts, for real:
the demo on 2 Gloo workers, each its own simulated node (``checkpoint.local_ranks_per_node =
1``, ``local_dir`` per ``{node}``), a node-local snapshot every 2 steps and a shared
checkpoint every 8. Rank 1 SIGKILLs itself twice (tests/e2e/scripts/demo_local_tier_killed.py):

* after step 11: the restart restores step 10 from the local tier (the shared one has step 8),
  each rank from its own node;
* after step 19, its node's local directory wiped first (a replaced node): the restart restores
  step 18, rank 1's shard from the replica rank 0's node kept.

The per-step losses of the whole run are bitwise those of an uninterrupted run without the tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import meshrun.demo

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "scripts" / "demo_local_tier_killed.py"
DEMO_CONFIG = Path(meshrun.demo.__file__).with_name("demo.toml")


def launch(run_dir: Path, target: list[str], extra: list[str], env: dict[str, str]) -> str:
    argv = [sys.executable, "-m", "meshrun", "launch", "--nproc-per-node", "2"]
    argv += ["--config", str(DEMO_CONFIG), "--max-restarts", "2", *target, "--size", "tiny"]
    argv += ["--corpus-bytes", "300000", f"--job.run_dir={run_dir}", "--optim.steps=24"]
    argv += ["--checkpoint.interval=8", "--metrics.progress=false", "--job.timeout_s=30", *extra]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    proc = subprocess.run(
        argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def losses(run_dir: Path) -> dict[int, float]:
    """The loss of each step, its last record (a redone step is logged again)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row and "loss" in row:
            out[row["step"]] = row["loss"]
    return out


@pytest.mark.timeout(420)
def test_restarts_restore_from_local_tier_and_from_a_peer_with_bitwise_losses(
    tmp_path: Path,
) -> None:
    launch(tmp_path / "ref", ["-m", "meshrun.demo"], [], {})
    run, local = tmp_path / "killed", tmp_path / "local"
    tier = ["--checkpoint.local_interval=2", "--checkpoint.local_ranks_per_node=1"]
    tier.append(f"--checkpoint.local_dir={local}/node{{node}}")
    markers = f"{tmp_path}/kill1,{tmp_path}/kill2"
    env = {"KILL_AFTER": "11,19", "KILL_MARKER": markers, "WIPE": "0,1"}
    env["WIPE_LOCAL_DIR"] = str(local / "node1")
    log = launch(run, [str(SCRIPT)], tier, env)
    assert log.count("; restart ") == 2 and "wiped 1" in (tmp_path / "kill2").read_text()
    said = [line.split("meshrun: ", 1)[1] for line in log.splitlines() if "restored from" in line]
    assert len(said) == 2, log[-3000:]
    assert said[0].startswith("restored from the node-local tier: step 10 (every rank from its own")
    assert said[1].startswith(
        "restored from the node-local tier: step 18 (1 rank(s) [1] from a peer"
    )
    assert "resumed from" not in log  # the shared checkpoint (step 8, 16) was not loaded
    events = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    restores = [(e["tier"], e["step"], e["fetched"]) for e in events if e.get("event") == "restore"]
    assert restores == [("local", 10, []), ("local", 18, [1])]
    ref, got = losses(tmp_path / "ref"), losses(run)
    assert sorted(got) == list(range(1, 25)) and got == ref  # bitwise: floats compared exactly
