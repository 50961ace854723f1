"""`meshrun report` and `meshrun scale-test` without processes: records written by hand in the
format the metrics logger writes, then the analysis, the scaling table, the HTML and the
errors a user meets first."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from meshrun.cli.main import main as cli_main
from meshrun.diagnose.scale import parse_sizes
from meshrun.report.analysis import ReportError, analyse, load_run, scaling

STEP_S = 0.1
EVAL_S = 0.3
T0 = 1_000_000.0


def step_row(step: int, t: float, step_time: float = STEP_S, loss: float | None = 2.0) -> dict:
    parts = {
        "data_wait_s": 0.01,
        "forward_s": 0.02,
        "backward_s": 0.04,
        "sync_s": 0.005,
        "optimizer_s": 0.01,
        "loop_s": 0.005,
    }
    return {
        "step": step,
        "time": t,
        "loss": loss,
        "lr": 1e-3,
        "step_time_s": step_time,
        "samples_per_s": 32 / step_time,
        "tokens_per_s": 1024 / step_time,
        "mem_rss_mb": 100.0 + step,
        **parts,
    }


def start(t: float, world: int = 2, global_batch: int = 32) -> dict:
    return {
        "event": "start",
        "time": t,
        "world_size": world,
        "dp": world,
        "global_batch": global_batch,
        "micro_batch": 8,
        "accum": 1,
        "device": "cpu",
        "host": "h",
    }


def write_run(path: Path, records: list[dict[str, Any]], tail: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (path / "metrics.jsonl").write_text(text)
    return path


def restarted_run(path: Path) -> Path:
    """Steps 1-6 (checkpoint after 4, a NaN skip at 3, a 1 s stall at 5, a straggler), a
    crash, a restart from step 4, steps 5-8 (5 and 6 redone, an evaluation before 7), a clean
    end."""
    t = T0 + 2.0  # 2 s of start-up after init
    recs: list[dict[str, Any]] = [start(T0)]
    for s in range(1, 7):
        dt = 1.0 if s == 5 else STEP_S
        t += dt
        recs.append(step_row(s, t, dt, loss=None if s == 3 else 2.0))
        if s == 3:
            recs.append(
                {"event": "nonfinite", "time": t, "step": 3, "ranks": [1], "action": "skip"}
            )
        if s == 4:
            recs.append({"event": "checkpoint", "time": t, "after_step": 4, "blocked_s": 0.9})
        if s == 6:
            ranks = [
                {
                    "rank": r,
                    "host": "h",
                    "step_time_s": 0.1,
                    "data_wait_s": 0.01,
                    "own_s": 0.05 + 0.05 * r,
                    "data_wait_share": 0.1,
                }
                for r in range(2)
            ]
            slowest = [{**ranks[1], "compute_s": 0.06, "optimizer_s": 0.01, "kind": "chronic"}]
            recs.append(
                {
                    "event": "ranks",
                    "time": t,
                    "step": 6,
                    "steps": 6,
                    "ranks": ranks,
                    "slowest": slowest,
                }
            )
            recs.append(
                {
                    "event": "straggler",
                    "time": t,
                    "rank": 1,
                    "host": "h",
                    "step": 6,
                    "component": "own_s",
                    "value_s": 0.1,
                    "median_s": 0.05,
                    "slower_by": 2.0,
                    "kind": "chronic",
                    "flagged": 3,
                    "windows": 5,
                }
            )
    t += 10.0  # the crash and the restart
    recs += [start(t), {"event": "resume", "time": t + 1, "from_step": 4}]
    t += 1.0
    for s in range(5, 9):
        if s == 7:  # run.evaluate between steps 6 and 7: out of step 7's time
            t += EVAL_S
            recs.append({"event": "eval", "time": t, "step": 6, "loss": 2.1, "seconds": EVAL_S})
        t += STEP_S
        recs.append({**step_row(s, t), **({"eval_s": EVAL_S} if s == 7 else {})})
    t += 0.5
    recs.append({"event": "summary", "time": t, "steps": 4.0, "total_time_s": 4 * STEP_S})
    return write_run(path, recs)


def test_restarted_run_figures_and_goodput_add_up(tmp_path: Path) -> None:
    fig = analyse(load_run(restarted_run(tmp_path / "r")))
    assert (fig.world_size, fig.global_batch, fig.steps_done, fig.restarts) == (2, 32, 8, 1)
    assert fig.median_step_s == pytest.approx(STEP_S)
    assert fig.samples_per_s == pytest.approx(32 / STEP_S)
    assert [e["step"] for e in fig.nonfinite] == [3] and len(fig.stragglers) == 1
    assert [(s.step, s.cause) for s in fig.stalls] == [(5, "checkpoint after step 4")]
    g = fig.goodput
    assert math.fsum(g.parts().values()) == pytest.approx(g.wall_s)
    assert g.wall_s == pytest.approx(2.0 + 1.5 + 10 + 1 + 0.4 + EVAL_S + 0.5)
    # The steps' measured time (1.5 s + 0.4 s) less the save inside step 5 (0.9 s), over the
    # 10 steps run: 0.1 s each.
    assert g.useful_s == pytest.approx(7 * STEP_S)  # 8 steps, one skipped
    assert g.skipped_s == pytest.approx(STEP_S)
    assert g.redone_s == pytest.approx(2 * STEP_S)  # steps 5 and 6 ran twice
    assert g.checkpoint_s == pytest.approx(0.9)
    assert g.eval_s == pytest.approx(EVAL_S)
    assert g.restarts_s == pytest.approx(10.0)  # the crash to the restart's start line
    assert g.outside_s == pytest.approx(2.0 + 1.0 + 0.5)  # set-up, resume, the end
    assert g.share == pytest.approx(0.7 / g.wall_s)
    b = fig.breakdown
    assert b["forward_s"] == pytest.approx(0.02) and b["other"] >= 0


def test_scaling_strong_weak_and_mixed(tmp_path: Path) -> None:
    def run(name: str, world: int, gb: int, step_s: float) -> Any:
        recs = [start(T0, world, gb)]
        recs += [
            {**step_row(s, T0 + s * step_s, step_s), "samples_per_s": gb / step_s}
            for s in range(1, 5)
        ]
        return analyse(load_run(write_run(tmp_path / name, recs)))

    strong = scaling([run("a", 1, 32, 0.4), run("b", 2, 32, 0.25), run("c", 4, 32, 0.2)])
    assert strong is not None and strong.kind == "strong"
    assert [r.world_size for r in strong.rows] == [1, 2, 4]
    assert [round(r.speedup, 3) for r in strong.rows] == [1.0, 1.6, 2.0]
    assert [round(r.efficiency, 3) for r in strong.rows] == [1.0, 0.8, 0.5]
    weak = scaling([run("d", 1, 8, 0.1), run("e", 2, 16, 0.125)])
    assert weak is not None and weak.kind == "weak"
    assert weak.rows[1].efficiency == pytest.approx(0.1 / 0.125)  # the step-time ratio
    mixed = scaling([run("f", 1, 8, 0.1), run("g", 2, 32, 0.1)])
    assert mixed is not None and mixed.kind == "mixed"
    assert scaling([run("h", 2, 32, 0.1)]) is None


def test_wrong_run_dirs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match="does not exist"):
        load_run(tmp_path / "nope")
    with pytest.raises(ReportError, match=r"no metrics.jsonl: is it a meshrun run directory"):
        load_run(tmp_path)
    with pytest.raises(ReportError, match="no training step yet"):
        load_run(write_run(tmp_path / "empty", [start(T0)]))


def test_a_line_cut_short_by_a_crash_is_skipped_and_said(tmp_path: Path) -> None:
    recs = [start(T0), step_row(1, T0 + 1), step_row(2, T0 + 2)]
    data = load_run(write_run(tmp_path / "cut", recs, tail='{"step": 3, "ti'))
    assert data.skipped_lines == 1 and len(data.rows) == 2


def test_report_cli_writes_html_with_every_png_embedded(tmp_path: Path, capsys: Any) -> None:
    pytest.importorskip("matplotlib")
    run_dir = restarted_run(tmp_path / "r")
    assert cli_main(["report", str(run_dir), "-o", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "1 restart(s)" in out
    assert "1 straggler flag(s) (chronic: rank 1)" in out
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert pngs == [
        "breakdown.png",
        "goodput.png",
        "loss.png",
        "memory.png",
        "ranks.png",
        "throughput.png",
    ]
    html = (tmp_path / "out" / "report.html").read_text()
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == len(pngs) and all(len(i) > 1000 for i in images)
    assert "checkpoint after step 4" in html and "http" not in html  # nothing fetched
    # Stragglers told apart: the flag's kind, the slowest ranks' moving averages.
    assert "<td>chronic (3 of 5)</td>" in html and "slowest ranks" in html
    assert "<td>1</td><td>h</td><td>10.0 ms</td><td>100.0 ms</td><td>60.0 ms</td>" in html


def test_report_cli_names_the_wrong_dir(tmp_path: Path, capsys: Any) -> None:
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "meshrun report: error:" in err and "missing" in err and "does not exist" in err


def test_missing_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: Any) -> None:
    from meshrun.report.figures import require_matplotlib

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ReportError, match=r"pip install 'meshrun\[report\]'"):
        require_matplotlib()


def test_scale_test_sizes_and_checks_before_any_process(tmp_path: Path, capsys: Any) -> None:
    assert parse_sizes("4,1,2,2") == [1, 2, 4]
    for bad in ("", "0,2", "a,b"):
        with pytest.raises(ValueError, match="--nproc"):
            parse_sizes(bad)
    out = str(tmp_path / "sc")
    # The demo's global batch 32 with micro-batch 8 does not divide over 3 processes.
    assert cli_main(["scale-test", "--nproc", "1,3", "--out", out, "-m", "meshrun.demo"]) == 2
    err = capsys.readouterr().err
    assert "at --nproc 3" in err and "global_batch" in err
    assert not Path(out, "nproc1").exists()  # nothing was started
    args = ["scale-test", "--nproc", "1", "--out", out, "-m", "meshrun.demo", "--job.run_dir=x"]
    assert cli_main(args) == 2
    assert "job.run_dir is set by scale-test" in capsys.readouterr().err


# --- throughput per rank and MFU (the metrics the report shows) -----------------------------


def test_gpu_names_map_to_the_planners_table() -> None:
    from meshrun.monitor.mfu import gpu_key

    assert gpu_key("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert gpu_key("NVIDIA H100 PCIe") == "h100-pcie"
    assert gpu_key("NVIDIA H200") == "h200"
    assert gpu_key("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert gpu_key("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert gpu_key("NVIDIA GeForce RTX 3090") is None


def test_peak_flops_sources_and_reasons() -> None:
    from meshrun.monitor.mfu import peak_flops

    assert peak_flops(5e10, "cpu", "", "fp32")[0] == 5e10
    value, why = peak_flops(0, "cpu", "", "fp32")
    assert value == 0 and "metrics.peak_flops" in why
    value, why = peak_flops(0, "cuda", "NVIDIA H100 80GB HBM3", "bf16")
    assert value == pytest.approx(989e12) and "h100-sxm" in why
    value, why = peak_flops(0, "cuda", "Tesla V100-SXM2-32GB", "bf16")  # no bf16 tensor cores
    assert value == 0 and "metrics.peak_flops" in why
    assert peak_flops(0, "cuda", "Some GPU", "bf16")[0] == 0


def test_metrics_rows_and_summary_carry_per_rank_throughput_and_mfu(tmp_path: Path) -> None:
    from meshrun.monitor.metrics import MetricsLogger

    with MetricsLogger(tmp_path, is_main=True, progress=False, world_size=4) as m:
        m.set_flops_per_token(1e6, peak_flops_per_rank=1e10)
        for step in (1, 2, 3):
            m.log_step(step, loss=1.0, lr=1e-3, step_time_s=0.5, samples=8, tokens=8000)
        summary = m.summary()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # 16,000 tokens/s over 4 ranks; 1e6 FLOPs/token x 16,000/s = 1.6e10 of 4e10 peak.
    assert rows[0]["tokens_per_s_per_rank"] == pytest.approx(4000)
    assert rows[0]["samples_per_s_per_rank"] == pytest.approx(4)
    assert rows[0]["mfu"] == pytest.approx(0.4)
    assert summary["mfu"] == pytest.approx(0.4) and rows[-1]["mfu"] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="must be > 0"):
        m.set_flops_per_token(0, 1e10)


def test_demo_flops_from_the_planner_agree_with_the_models_own_estimate() -> None:
    from dataclasses import replace

    from meshrun.demo.model import GPT, demo_config
    from meshrun.demo.train import plan_flops_per_token

    cfg = replace(demo_config("small"), vocab_size=257)
    # Planner (Narayanan et al.) vs PaLM's 6N + 12 l h s: the logits term differs slightly.
    assert plan_flops_per_token(cfg) == pytest.approx(GPT(cfg).flops_per_token(), rel=0.02)


def test_files_without_start_records_split_at_a_step_going_back(tmp_path: Path) -> None:
    # metrics.jsonl written before start records existed: a resume shows as steps going back.
    recs = [step_row(s, T0 + s) for s in (1, 2, 3, 4)] + [
        step_row(s, T0 + 10 + s) for s in (3, 4, 5)
    ]
    fig = analyse(load_run(write_run(tmp_path / "old", recs)))
    assert fig.restarts == 1 and fig.steps_done == 5
    assert fig.goodput.redone_s == pytest.approx(2 * STEP_S)  # steps 3 and 4 ran twice
    assert any("no start record" in n for n in fig.notes)


def test_log_every_counts_every_step_not_only_the_logged_ones(tmp_path: Path) -> None:
    recs = [start(T0), step_row(5, T0 + 0.5), step_row(10, T0 + 1.0)]
    recs.append({"event": "summary", "time": T0 + 1.1, "steps": 10.0, "total_time_s": 1.0})
    run_dir = write_run(tmp_path / "every5", recs)
    (run_dir / "config.toml").write_text("[metrics]\nlog_every = 5\n")
    fig = analyse(load_run(run_dir))
    assert fig.goodput.useful_s == pytest.approx(10 * STEP_S)  # ten steps, not two
    assert fig.goodput.redone_s == 0
    assert math.fsum(fig.goodput.parts().values()) == pytest.approx(fig.goodput.wall_s)
    assert any("log_every = 5" in n for n in fig.notes)


def test_goodput_stays_under_the_wall_time_when_the_median_step_exceeds_the_mean(
    tmp_path: Path,
) -> None:
    """A machine that gets quieter mid-run: 7 steps of 0.8 s, then 4 of 0.2 s. The median
    (0.8 s) times the 11 steps is 8.8 s, more than the 6.4 s they took (and than the 7.6 s
    wall time); the useful steps are what they measured."""
    times = [0.8] * 7 + [0.2] * 4
    t, recs = T0 + 1.0, [start(T0)]
    for s, dt in enumerate(times, 1):
        t += dt
        recs.append(step_row(s, t, dt))
    recs.append({"event": "summary", "time": t + 0.2, "steps": 11.0, "total_time_s": sum(times)})
    fig = analyse(load_run(write_run(tmp_path / "quieter", recs)))
    g = fig.goodput
    assert fig.median_step_s == pytest.approx(0.8)
    assert g.useful_s == pytest.approx(sum(times)) and g.share < 1.0
    assert g.outside_s == pytest.approx(1.0 + 0.2)
    assert math.fsum(g.parts().values()) == pytest.approx(g.wall_s)
