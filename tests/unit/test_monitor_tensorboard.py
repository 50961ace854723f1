"""The TensorBoard sink: one writer (the main rank), the step lines' numbers as scalars that
TensorBoard's own reader gets back, and a clear error without the package."""

import sys
from pathlib import Path

import pytest

from meshrun.monitor.metrics import MetricsLogger
from meshrun.monitor.tensorboard import TENSORBOARD_DIR, check_tensorboard


def log_three_steps(run_dir: Path, is_main: bool) -> None:
    with MetricsLogger(
        run_dir, is_main=is_main, progress=False, total_steps=3, tensorboard=True
    ) as m:
        for step in (1, 2, 3):
            m.log_step(
                step,
                loss=4.0 - step,
                lr=0.1,
                step_time_s=0.5,
                samples=8,
                tokens=64,
                extra={"comm_exposed_s": 0.01 * step, "data_wait_s": float("nan")},
            )


def test_scalars_are_written_once_and_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_three_steps(tmp_path / "other", is_main=False)
    assert not (tmp_path / "other" / TENSORBOARD_DIR).exists()  # only the main rank writes
    log_three_steps(tmp_path, is_main=True)
    files = list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/tokens_per_s", "train/comm_exposed_s"} <= tags
    assert "train/data_wait_s" not in tags  # NaN is not a point
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 3.0), (2, 2.0), (3, 1.0)]


def test_without_the_package_the_error_says_how_to_fix_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import fails
    with pytest.raises(RuntimeError, match=r"metrics\.tensorboard.*pip install"):
        check_tensorboard()
