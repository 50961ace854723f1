"""MetricsLogger and memory_stats: what is written, where, and what the summary says."""

from __future__ import annotations

import io
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from meshrun.monitor import METRICS_FILE, MetricsLogger, memory_stats


def plain_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    # Narrow on purpose: a log line must not be wrapped at the console width.
    return Console(file=buf, force_terminal=False, width=40), buf


def read_jsonl(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def log_n(logger: MetricsLogger, n: int, step_time_s: float = 0.5, **extra: float) -> None:
    for step in range(1, n + 1):
        logger.log_step(
            step,
            loss=10.0 / step,
            lr=3e-4,
            step_time_s=step_time_s,
            samples=8,
            tokens=1000,
            extra=extra or None,
        )


def test_jsonl_written_at_log_every_multiples_and_last_step(tmp_path: Path) -> None:
    console, _ = plain_console()
    with MetricsLogger(tmp_path, is_main=True, log_every=3, total_steps=7, console=console) as m:
        log_n(m, 7)
    rows = read_jsonl(tmp_path)
    assert [r["step"] for r in rows[:-1]] == [3, 6, 7]
    assert rows[-1]["event"] == "summary"
    assert rows[-1]["steps"] == 7


def test_jsonl_record_keys_and_values(tmp_path: Path) -> None:
    console, _ = plain_console()
    before = time.time()
    with MetricsLogger(tmp_path, is_main=True, console=console) as m:
        m.log_step(
            1, loss=2.5, lr=1e-3, step_time_s=0.25, samples=16, tokens=4096, extra={"mem_x_mb": 7.0}
        )
    row = read_jsonl(tmp_path)[0]
    assert row["step"] == 1
    assert row["loss"] == 2.5
    assert row["lr"] == 1e-3
    assert row["step_time_s"] == 0.25
    assert row["samples_per_s"] == pytest.approx(16 / 0.25)
    assert row["tokens_per_s"] == pytest.approx(4096 / 0.25)
    assert row["mem_x_mb"] == 7.0
    assert before <= row["time"] <= time.time()


def test_records_reach_the_file_before_close(tmp_path: Path) -> None:
    # What a crash would leave behind: every logged line, with no close() to flush it.
    m = MetricsLogger(tmp_path, is_main=True, console=plain_console()[0])
    log_n(m, 2)
    assert [r["step"] for r in read_jsonl(tmp_path)] == [1, 2]
    m.close()


def test_jsonl_appends_across_loggers(tmp_path: Path) -> None:
    # A resumed run continues the same file instead of truncating it.
    for _ in range(2):
        with MetricsLogger(tmp_path, is_main=True, console=plain_console()[0]) as m:
            log_n(m, 1)
    assert [r.get("event", "step") for r in read_jsonl(tmp_path)] == [
        "step",
        "summary",
        "step",
        "summary",
    ]


def test_non_finite_values_are_written_as_null(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, is_main=True, console=plain_console()[0]) as m:
        m.log_step(1, loss=float("nan"), lr=1e-3, step_time_s=0.1, samples=1, tokens=1)
    assert read_jsonl(tmp_path)[0]["loss"] is None


def test_non_main_writes_nothing_but_keeps_totals(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    console, buf = plain_console()
    with MetricsLogger(run_dir, is_main=False, total_steps=3, console=console) as m:
        log_n(m, 3)
    assert not run_dir.exists()
    assert buf.getvalue() == ""
    assert m.summary()["steps"] == 3
    assert m.summary()["tokens"] == 3000


def test_plain_line_format_on_non_terminal_console(tmp_path: Path) -> None:
    console, buf = plain_console()
    with MetricsLogger(tmp_path, is_main=True, total_steps=10, console=console) as m:
        m.log_step(1, loss=9.0, lr=3e-4, step_time_s=1.0, samples=4, tokens=2000)
        m.log_step(2, loss=3.21543, lr=3e-4, step_time_s=0.4, samples=4, tokens=2000)
    lines = buf.getvalue().splitlines()
    # ETA: 8 steps left at the median of steps after the warm-up step (0.4 s) = 3.2 s;
    # counting step 1 would give 5.6 s.
    assert (
        lines[1] == "step  2/10 | loss 3.2154 | lr 3.00e-04 | 0.400 s/step | 5,000 tok/s | ETA 0:03"
    )
    assert "\x1b[" not in buf.getvalue()


def test_progress_bar_on_terminal_console(tmp_path: Path) -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=160)
    with MetricsLogger(tmp_path, is_main=True, total_steps=4, console=console) as m:
        log_n(m, 4)
    out = buf.getvalue()
    assert "4/4" in out
    assert "loss 2.5000" in out
    assert "step   " not in out  # no plain lines alongside the bar
    assert "training summary" in out


def test_summary_median_excludes_first_step(tmp_path: Path) -> None:
    m = MetricsLogger(tmp_path, is_main=False)
    for step, dt in enumerate([10.0, 1.0, 2.0, 3.0], start=1):
        m.log_step(
            step, loss=float(step), lr=1e-3, step_time_s=dt, samples=2, tokens=100, extra=None
        )
    s = m.summary()
    assert s["step_time_median_s"] == 2.0
    assert s["step_time_mean_s"] == 2.0
    assert s["tokens_per_s"] == pytest.approx(100 / 2.0)
    assert s["samples_per_s"] == pytest.approx(2 / 2.0)
    assert s["total_time_s"] == 16.0
    assert (s["loss_first"], s["loss_last"]) == (1.0, 4.0)


def test_summary_single_step_uses_it() -> None:
    m = MetricsLogger("unused", is_main=False)
    m.log_step(1, loss=1.0, lr=1e-3, step_time_s=5.0, samples=1, tokens=10)
    assert m.summary()["step_time_median_s"] == 5.0


def test_summary_peak_memory_is_max_seen(tmp_path: Path) -> None:
    m = MetricsLogger(tmp_path, is_main=False)
    for step, (alloc, reserved) in enumerate([(100.0, 150.0), (300.0, 200.0), (50.0, 120.0)], 1):
        m.log_step(
            step,
            loss=1.0,
            lr=1e-3,
            step_time_s=0.1,
            samples=1,
            tokens=1,
            extra={"mem_peak_alloc_mb": alloc, "mem_reserved_mb": reserved, "grad_norm": 900.0},
        )
    s = m.summary()
    assert s["mem_peak_alloc_mb"] == 300.0
    assert s["mem_reserved_mb"] == 200.0
    assert s["mem_peak_mb"] == 300.0  # grad_norm is not memory


def test_close_is_idempotent(tmp_path: Path) -> None:
    console, buf = plain_console()
    m = MetricsLogger(tmp_path, is_main=True, console=console)
    log_n(m, 2)
    m.close()
    m.close()
    assert [r.get("event") for r in read_jsonl(tmp_path)].count("summary") == 1
    assert buf.getvalue().count("training summary") == 1
    with pytest.raises(RuntimeError, match="after close"):
        log_n(m, 1)


class BrokenFile(io.StringIO):
    def write(self, s: str) -> int:
        raise OSError("terminal went away")


def test_console_failure_does_not_stop_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    console = Console(file=BrokenFile(), force_terminal=False)
    with (
        caplog.at_level(logging.WARNING, logger="meshrun.monitor.metrics"),
        MetricsLogger(tmp_path, is_main=True, console=console) as m,
    ):
        log_n(m, 3)
    assert len(read_jsonl(tmp_path)) == 4  # 3 steps + summary, despite the console
    warnings = [r for r in caplog.records if "console" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_jsonl_write_failure_raises(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).symlink_to("/dev/full")
    m = MetricsLogger(tmp_path, is_main=True, console=plain_console()[0])
    with pytest.raises(OSError):
        log_n(m, 1)
    with pytest.raises(OSError):  # the summary record cannot be written either
        m.close()


def test_bad_settings_name_the_key() -> None:
    with pytest.raises(ValueError, match="log_every=0"):
        MetricsLogger("unused", is_main=False, log_every=0)
    with pytest.raises(ValueError, match="total_steps=-1"):
        MetricsLogger("unused", is_main=False, total_steps=-1)


def test_extra_may_not_overwrite_core_keys() -> None:
    m = MetricsLogger("unused", is_main=False)
    with pytest.raises(ValueError, match="loss"):
        m.log_step(1, loss=1.0, lr=1.0, step_time_s=1.0, samples=1, tokens=1, extra={"loss": 2.0})


def test_memory_stats_cpu_reports_positive_rss() -> None:
    stats = memory_stats(torch.device("cpu"))
    assert stats["mem_rss_mb"] > 0
    # Peak is read after current; the kernel's counters lag a little, hence the slack.
    # A KiB/bytes mix-up would be off by 1024x.
    assert stats["mem_peak_rss_mb"] >= 0.9 * stats["mem_rss_mb"]
    assert not any(k.startswith(("mem_peak_alloc", "mem_reserved")) for k in stats)


PLAIN_CHILD = """
import sys, tempfile
from meshrun.monitor.metrics import MetricsLogger
with MetricsLogger(tempfile.mkdtemp(), is_main=True, total_steps=2) as m:
    m.log_step(1, loss=1.0, lr=1e-3, step_time_s=0.1, samples=8, tokens=None)
    print("rich imported before the summary:", "rich" in sys.modules, file=sys.stderr)
"""


def test_plain_lines_to_a_pipe_need_no_rich_and_the_summary_still_prints(tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    p = subprocess.run(
        [sys.executable, "-c", PLAIN_CHILD],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    assert "rich imported before the summary: False" in p.stderr
    lines = p.stdout.splitlines()
    assert (
        lines[0]
        == "step 1/2 | loss 1.0000 | lr 1.00e-03 | 0.100 s/step | 80.0 samples/s | ETA 0:00"
    )
    assert any("training summary" in line for line in lines[1:])
