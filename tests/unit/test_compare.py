"""`meshrun compare`'s pure parts: two runs' records compared step by step
(diagnose/compare.py), and the planner's layout syntax as launch overrides
(diagnose/compare_launch.py). Records are written here as a recording run writes them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from meshrun.cli.main import main as cli_main
from meshrun.config import ConfigError
from meshrun.diagnose.compare import (
    compare_runs,
    param_diffs,
    read_run,
    relative,
    summary_lines,
    tensor_relative,
)
from meshrun.diagnose.compare_launch import CompareSpec, layout_overrides, shared_global_batch
from meshrun.train.record import record_file

pytestmark = pytest.mark.timeout(60)


def _write_run(run_dir: Path, losses: list[float], params: dict[str, list[torch.Tensor]]) -> Path:
    """``losses[k-1]`` at step k; ``params[name][k-1]`` the value (its gradient: 2 x value)."""
    run_dir.mkdir()
    rows: list[dict[str, object]] = [{"step": k, "loss": x} for k, x in enumerate(losses, 1)]
    rows.insert(0, {"event": "start", "step": 0})  # events are not steps
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for k in range(1, len(losses) + 1):
        tensors = {f"value/{n}": v[k - 1].clone() for n, v in params.items()}
        tensors |= {f"grad/{n}": 2 * v[k - 1] for n, v in params.items()}
        path = record_file(run_dir, k, 0)
        path.parent.mkdir(exist_ok=True)
        save_file(tensors, str(path))
    return run_dir


def test_relative_differences_are_symmetric_scale_free_and_nan_is_never_equal() -> None:
    assert relative(2.0, 2.0) == 0.0 and relative(0.0, 0.0) == 0.0
    assert relative(1.0, 2.0) == relative(2.0, 1.0) == 0.5
    assert relative(1e-9, 2e-9) == pytest.approx(0.5)
    assert relative(1.0, math.nan) == math.inf
    a = torch.tensor([3.0, 4.0])
    assert tensor_relative(a, a.clone()) == 0.0
    assert tensor_relative(a, torch.zeros(2)) == 1.0
    assert tensor_relative(a, torch.ones(3)) == math.inf  # another shape: never equal


def test_runs_that_agree_within_the_tolerance(tmp_path: Path) -> None:
    w = [torch.ones(2, 2), torch.ones(2, 2) * 0.9]
    base = read_run(_write_run(tmp_path / "a", [4.0, 3.0], {"fc.weight": w}))
    other = read_run(_write_run(tmp_path / "b", [4.0, 3.0 * (1 + 1e-7)], {"fc.weight": w}))
    assert base.losses == {1: 4.0, 2: 3.0}
    result = compare_runs(base, other, steps=2, tolerance=1e-5)
    assert result.agrees and result.first_beyond is None
    assert result.largest == (2, pytest.approx(1e-7, rel=1e-3))
    assert "agrees" in summary_lines("zero=3", result, 1e-5)[0]


def test_the_first_step_beyond_names_the_parameters_that_differ_most(tmp_path: Path) -> None:
    same, drift = torch.ones(4), [torch.ones(4) * 1.5] * 2
    base = read_run(
        _write_run(tmp_path / "a", [4.0, 3.0, 2.0], {"a.w": [same] * 3, "b.w": [same] * 3})
    )
    moved = {"a.w": [same] * 3, "b.w": [same, *drift]}
    other = read_run(_write_run(tmp_path / "b", [4.0, 3.3, 2.0], moved))
    result = compare_runs(base, other, steps=3, tolerance=1e-5)
    assert not result.agrees and result.first_beyond == 2
    assert [p.name for p in result.params] == ["b.w", "a.w"]
    assert result.params[0].value == pytest.approx(0.5 / 1.5)
    assert result.params[1].value == result.params[1].grad == 0.0
    text = "\n".join(summary_lines("zero=3", result, 1e-5))
    assert "DIFFERS from step 2" in text and "b.w" in text


def test_a_nan_loss_is_beyond_any_tolerance_and_missing_steps_never_agree(tmp_path: Path) -> None:
    base = read_run(_write_run(tmp_path / "a", [4.0, 3.0], {}))
    nan = read_run(_write_run(tmp_path / "b", [4.0, math.nan], {}))
    short = read_run(_write_run(tmp_path / "c", [4.0], {}))
    assert compare_runs(base, nan, 2, tolerance=1.0).first_beyond == 2
    result = compare_runs(base, short, 2, tolerance=1e-5)
    assert not result.agrees and result.missing_steps == [2]
    assert "NO LOSS recorded for step 2" in summary_lines("tp=2", result, 1e-5)[0]


def test_names_only_one_run_records_are_listed_not_compared() -> None:
    t = torch.ones(2)
    diffs, only = param_diffs({"value/x": t, "value/y": t}, {"value/x": t, "grad/x": t})
    assert [d.name for d in diffs] == ["x"] and only == ["y"]
    assert diffs[0].grad == math.inf  # a gradient on one side only


def test_layouts_become_every_mesh_key_and_what_the_text_names() -> None:
    assert layout_overrides("zero=3", 2) == [
        "--parallel.dp_replicate=1",
        "--parallel.dp_shard=2",
        "--parallel.tp=1",
        "--parallel.pp=1",
        "--parallel.cp=1",
        "--parallel.ep=1",
        "--parallel.zero=3",
    ]
    pp = layout_overrides("pp=2,schedule=gpipe,micro_batch=4", 4)
    assert "--parallel.dp_shard=2" in pp and "--parallel.pp_schedule=gpipe" in pp
    assert "--data.micro_batch=4" in pp
    assert "--parallel.activation_checkpoint=1" in layout_overrides("tp=2,ac=full", 2)
    assert "--parallel.dp_shard=1" in layout_overrides("", 1)  # the one-process run


@pytest.mark.parametrize(
    ("text", "named"),
    [("tp=3", "tp"), ("zero=4", "zero=4"), ("dp=2", "dp=2"), ("dp_shard=4", "4 processes")],
)
def test_a_bad_layout_is_refused_naming_the_item(text: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        layout_overrides(text, 2)


def test_one_global_batch_for_every_run(tmp_path: Path) -> None:
    def spec(*args: str, layouts: tuple[str, ...] = ("zero=3", "tp=2")) -> CompareSpec:
        return CompareSpec("train.py", list(args), 2, 3, list(layouts), 1e-5)

    assert shared_global_batch(spec("--data.micro_batch=4")) == 8  # micro x the largest dp
    assert shared_global_batch(spec("--data.micro_batch=4", layouts=("tp=2",))) == 4
    assert shared_global_batch(spec("--data.global_batch=12", "--lr", "3")) == 12


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--steps", "0"], "--steps 0: must be >= 1"),
        (["--nproc", "0"], "--nproc 0: must be >= 1"),
        (["--tolerance", "-1"], "--tolerance -1.0: must be >= 0"),
        (["--layout", "tp=3"], "--layout"),
        (["--layout", "dp_shard=4"], "--nproc is 2"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag_before_any_run(
    flags: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    out = tmp_path / "out"
    assert cli_main(["compare", *flags, "--out", str(out), str(script)]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()  # nothing launched


def test_a_missing_script_and_a_used_out_directory_are_refused(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "x").write_text("")
    assert cli_main(["compare", str(tmp_path / "nope.py")]) == 2
    script = tmp_path / "train.py"
    script.write_text("")
    assert cli_main(["compare", "--out", str(tmp_path / "old"), str(script)]) == 2
