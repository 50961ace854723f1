"""What a ported script needs from ``Run`` besides the loop, checked without a process group:
``meshrun.init()`` takes its ``--section.key=value`` overrides out of ``sys.argv`` (so a
strict ``parse_args()`` after it sees only the script's own flags), ``run.unwrap`` peels the
wrappers, parameter groups are checked against the parallelized model, and ``run.evaluate``
weights each batch by its size and gives every module its own mode back.

The multi-process side (ZeRO-1/ZeRO-3 groups, evaluation with uneven shares) is
tests/dist/test_run_glue_ranks.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from meshrun.config import ConfigError
from meshrun.parallel.param_groups import check_param_groups
from meshrun.train.model import unwrap_module
from meshrun.train.startup import resolve_config

ROOT = Path(__file__).resolve().parents[2]


def test_init_takes_its_overrides_out_of_sys_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["train.py", "--optim.steps=7", "--batch", "4", "--data.micro_batch", "2", "x.txt"]
    monkeypatch.setattr(sys, "argv", list(argv))
    held = sys.argv  # a reference taken before init sees the change too (edited in place)
    cfg = resolve_config(None, None)
    assert (cfg.optim.steps, cfg.data.micro_batch) == (7, 2)
    assert sys.argv == ["train.py", "--batch", "4", "x.txt"] and held is sys.argv


def test_keep_argv_and_an_explicit_argv_leave_sys_argv_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = ["train.py", "--optim.steps=7", "--batch", "4"]
    monkeypatch.setattr(sys, "argv", list(argv))
    assert resolve_config(None, None, keep_argv=True).optim.steps == 7
    assert sys.argv == argv
    assert resolve_config(None, ["--optim.steps=9"]).optim.steps == 9
    assert sys.argv == argv


def test_a_bad_override_leaves_sys_argv_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["train.py", "--optim.stepz=7"]
    monkeypatch.setattr(sys, "argv", list(argv))
    with pytest.raises(ConfigError, match="stepz"):
        resolve_config(None, None)
    assert sys.argv == argv


def test_a_strict_argparse_script_runs_after_init(tmp_path: Path) -> None:
    script = ROOT / "tests" / "e2e" / "scripts" / "strict_argparse.py"
    args = ["--optim.steps=3", "--eval-batches", "3", "--optim.lr", "0.5", "--tag=a.b"]
    p = subprocess.run(
        [sys.executable, str(script), *args, f"--job.run_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["argv"] == ["--eval-batches", "3", "--tag=a.b"]
    assert out["args"] == {"eval_batches": 3, "tag": "a.b"}
    assert (out["steps"], out["lr"]) == (3, 0.5)
    # The size-weighted mean over the 3 batches (3, 5 and 2 samples), in eval mode
    assert out["loss"] == pytest.approx(out["expected"], rel=1e-6)
    # ... and each module's own mode afterwards: the dropout the user had put in eval stays so.
    assert out["modes"] == [True, True, True, False, True]
    assert out["unwrap_is_net"] is True


def test_unwrap_peels_compile_and_refuses_a_pipeline() -> None:
    from meshrun.parallel import Pipeline

    net = nn.Linear(2, 2)
    assert unwrap_module(torch.compile(net)) is net  # compiles nothing until called
    assert unwrap_module(net) is net
    pipe = Pipeline.__new__(Pipeline)
    with pytest.raises(TypeError, match=r"pipe\.modules"):
        unwrap_module(pipe)


def groups_of(model: nn.Module) -> list[dict[str, object]]:
    """nanoGPT's rule: matrices decay, biases and norms do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def test_param_groups_are_checked_against_the_model() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    out = check_param_groups(model, groups_of(model))
    assert [len(g["params"]) for g in out] == [1, 3]
    assert [g["weight_decay"] for g in out] == [0.1, 0.0]
    stale = groups_of(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)))  # another model's
    with pytest.raises(ConfigError, match=r"param_groups\[0\].*not parameters.*after that call"):
        check_param_groups(model, stale)
    with pytest.raises(ConfigError, match=r"leave 3 trainable.*0\.bias, 1\.weight, 1\.bias"):
        check_param_groups(model, groups_of(model)[:1])
    with pytest.raises(ConfigError, match=r'param_groups\[0\] is list.*"params"'):
        check_param_groups(model, [list(model.parameters())])  # type: ignore[list-item]
    model[1].requires_grad_(False)  # frozen parameters need no group
    assert len(check_param_groups(model, groups_of(model))) == 2


def test_a_batch_counts_by_its_first_tensor() -> None:
    from meshrun.train.evaluate import _batch_size

    batch = {"names": ["a", "b", "c"], "image": torch.zeros(3, 2), "label": torch.zeros(3)}
    assert _batch_size(batch) == 3  # a list of strings first is passed over
    assert _batch_size([torch.zeros(5, 1), torch.zeros(5)]) == 5
    with pytest.raises(TypeError, match="cannot tell the size"):
        _batch_size({"names": ["a"]})
