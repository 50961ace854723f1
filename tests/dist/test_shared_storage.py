"""The run directory must be shared by every rank: two ranks that see different run
directories (what two hosts with their own disks give) stop in ``meshrun.init``, before step 1,
with an error that names each directory and the fix; a shared one passes and leaves no marker.
Real Gloo processes; the message itself is unit-tested in tests/unit/test_storage.py."""

from __future__ import annotations

import resource
import signal
import tempfile
from pathlib import Path

import pytest

from _dist import run_distributed

pytestmark = pytest.mark.slow


def start(rank: int, world: int, root: str, per_rank: bool, full_on_rank0: bool = False) -> str:
    import meshrun
    from meshrun.runtime.storage import RunDirError

    if full_on_rank0 and rank == 0:  # any write fails with EFBIG, as on a full disk
        # Imports first (torch probes the temp dir with a write), and the temp dir is cached.
        import meshrun.train.run

        tempfile.gettempdir()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    cfg = meshrun.Config()
    cfg.job.run_dir = f"{root}/host{rank}" if per_rank else f"{root}/shared"
    cfg.job.device, cfg.job.timeout_s, cfg.metrics.progress = "cpu", 60.0, False
    cfg.data.global_batch, cfg.data.micro_batch = 2, 1
    try:
        run = meshrun.init(cfg, argv=[])
    except RunDirError as e:
        return f"error: {e}"
    steps = run.step
    run.close()
    return f"ok at step {steps}"


@pytest.mark.timeout(120)
def test_ranks_with_different_run_dirs_stop_at_init_naming_the_directory(tmp_path: Path) -> None:
    outcomes = run_distributed(start, 2, str(tmp_path), True, timeout=90)
    for text in outcomes:  # every rank raises the same error, so the job stops as one
        assert text.startswith("error: job.run_dir is not shared by all ranks"), text
        assert "wrote .meshrun-shared-" in text and f"in {tmp_path}/host0" in text, text
        assert "rank 1 on " in text and f"in {tmp_path}/host1" in text, text
        assert "--job.run_dir=/shared/runs/NAME" in text, text
    assert outcomes[0] == outcomes[1]
    # The marker is removed once every rank has looked.
    assert not list((tmp_path / "host0").glob(".meshrun-shared-*"))
    assert not (tmp_path / "host1" / "checkpoints").exists()  # nothing ran


@pytest.mark.timeout(120)
def test_a_shared_run_dir_passes_and_leaves_no_marker(tmp_path: Path) -> None:
    assert run_distributed(start, 2, str(tmp_path), False, timeout=90) == ["ok at step 0"] * 2
    assert not list((tmp_path / "shared").glob(".meshrun-shared-*"))


@pytest.mark.timeout(120)
def test_a_run_dir_rank_0_cannot_write_stops_every_rank_naming_it(tmp_path: Path) -> None:
    outcomes = run_distributed(start, 2, str(tmp_path), False, True, timeout=90)
    for text in outcomes:  # rank 1 does not wait for a marker that never comes
        assert text.startswith(f"error: job.run_dir {tmp_path}/shared: rank 0 on "), text
        assert "cannot write in it" in text and "File too large" in text, text
