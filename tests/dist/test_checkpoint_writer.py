"""The hashing DCP writer and the launcher's check of ``checkpoint.resume=PATH`` (one process,
no process group: DCP saves without one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from meshrun.checkpoint import on_disk
from meshrun.checkpoint.writer import hashing_writer
from meshrun.cli.main import main as cli_main


def test_digests_made_while_writing_equal_a_reread_and_verify(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {
        "model": {f"w{i}": torch.randn(300, 257, generator=g) for i in range(5)},
        "optim": {"step": torch.tensor(3.0), "half": torch.randn(7, generator=g).half()},
    }
    writer, fs = hashing_writer(tmp_path / "ck")
    dcp.save(state, storage_writer=writer)
    shards = sorted(p.name for p in (tmp_path / "ck").glob("*.distcp"))
    assert shards and sorted(fs.digests) == shards
    assert fs.digests == on_disk.hash_files(tmp_path / "ck", shards)  # same bytes, same SHA-256
    manifest = on_disk.build_manifest(tmp_path / "ck", step=1, meta={}, known=fs.digests)
    on_disk.commit_dir(tmp_path / "ck", tmp_path / "step_00000001", manifest)
    assert on_disk.problems(tmp_path / "step_00000001") == []
    loaded = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "step_00000001"))
    assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())


def _launch(tmp_path: Path, resume: str) -> int:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    argv = ["launch", "--nproc-per-node", "1", str(script), f"--job.run_dir={tmp_path / 'run'}"]
    return cli_main([*argv, f"--checkpoint.resume={resume}"])


@pytest.mark.timeout(60)
def test_launch_refuses_a_bad_resume_path_before_spawning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _launch(tmp_path, str(tmp_path / "step_00000009")) == 2
    err = capsys.readouterr().err
    assert "checkpoint.resume" in err and "does not exist" in err, err
    ck = tmp_path / "step_00000004"
    ck.mkdir()
    (ck / "a.bin").write_bytes(b"x" * 10)
    manifest = on_disk.build_manifest(ck, step=4, meta={})
    on_disk.commit_dir(ck, tmp_path / "step_00000005", manifest)
    (tmp_path / "step_00000005" / "a.bin").write_bytes(b"x" * 4)  # truncated
    assert _launch(tmp_path, str(tmp_path / "step_00000005")) == 2
    err = capsys.readouterr().err
    assert "a.bin: size 4 bytes, manifest says 10" in err, err
    assert not (tmp_path / "run" / "config.toml").exists()  # refused before anything was written
