"""Two runs of one script compared step by step: what ``meshrun compare`` reports.

Reads what a run with ``monitor.record_steps = K`` leaves in its directory (train/record.py):
each step's global mean loss (``metrics.jsonl``, ``metrics.log_every = 1``) and each step's
whole parameters and gradients before the update (``record/step*-rank*.safetensors``, one file
per pipeline stage). Pure: no process group; unit-tested on files it writes itself.

A relative difference is ``|a - b| / max(|a|, |b|)`` for a loss and
``||a - b|| / max(||a||, ||b||)`` (2-norms) for a tensor: 0 for equal values, 1 for one of two
values 0, scale-free, symmetric, so one tolerance fits every model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "LayoutComparison",
    "ParamDiff",
    "RunRecord",
    "compare_runs",
    "read_run",
    "relative",
    "tensor_relative",
]

TOP_PARAMS = 5  # parameters named at the first step beyond the tolerance


@dataclass(frozen=True)
class RunRecord:
    """One run's losses by step and its record files by step (empty without records)."""

    run_dir: Path
    losses: dict[int, float]
    files: dict[int, list[Path]]

    def tensors(self, step: int) -> dict[str, torch.Tensor]:
        """Step ``step``'s ``value/NAME`` and ``grad/NAME`` tensors, every stage's together."""
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for path in self.files.get(step, []):
            out.update(load_file(str(path)))
        return out


@dataclass(frozen=True)
class ParamDiff:
    """One parameter's relative difference from one process at a step (NaN: not compared)."""

    name: str
    value: float
    grad: float


@dataclass(frozen=True)
class LayoutComparison:
    """A layout's run against one process's: per step ``(step, base loss, loss, relative
    difference)``, the first step beyond the tolerance (None: none), the parameters differing
    most there, and the names only one of the two runs recorded."""

    steps: list[tuple[int, float, float, float]]
    first_beyond: int | None
    params: list[ParamDiff] = field(default_factory=list)
    only_one_side: list[str] = field(default_factory=list)
    missing_steps: list[int] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return self.first_beyond is None and not self.missing_steps

    @property
    def largest(self) -> tuple[int, float] | None:
        """The step with the largest relative loss difference, and that difference."""
        if not self.steps:
            return None
        step = max(self.steps, key=lambda s: _nan_high(s[3]))
        return step[0], step[3]


def relative(a: float, b: float) -> float:
    """``|a - b| / max(|a|, |b|)``; 0 for two zeros, inf where exactly one is not finite."""
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def tensor_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / max(||a||, ||b||)`` in float64; inf for different shapes."""
    if a.shape != b.shape:
        return math.inf
    a, b = a.double(), b.double()
    scale = max(float(a.norm()), float(b.norm()))
    diff = float((a - b).norm())
    return 0.0 if diff == 0 else diff / scale if scale else math.inf


def read_run(run_dir: Path) -> RunRecord:
    """The losses of ``run_dir/metrics.jsonl``'s step lines and its record files by step."""
    losses: dict[int, float] = {}
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "step" in row and "loss" in row and "event" not in row:
                losses[int(row["step"])] = float(row["loss"])
    files: dict[int, list[Path]] = {}
    for path in sorted((run_dir / "record").glob("step*-rank*.safetensors")):
        step = int(path.name[len("step") :].split("-", 1)[0])
        files.setdefault(step, []).append(path)
    return RunRecord(run_dir, losses, files)


def compare_runs(
    base: RunRecord, other: RunRecord, steps: int, tolerance: float
) -> LayoutComparison:
    """``other`` against ``base`` over steps 1..``steps``: the first step whose relative loss
    difference exceeds ``tolerance``, and there the parameters whose value or gradient differ
    most (by the larger of the two)."""
    rows = [
        (s, base.losses[s], other.losses[s], relative(base.losses[s], other.losses[s]))
        for s in range(1, steps + 1)
        if s in base.losses and s in other.losses
    ]
    missing = [s for s in range(1, steps + 1) if s not in base.losses or s not in other.losses]
    first = next((s for s, _, _, d in rows if not d <= tolerance), None)  # NaN counts as beyond
    if first is None:
        return LayoutComparison(rows, None, missing_steps=missing)
    params, one_side = param_diffs(base.tensors(first), other.tensors(first), tolerance)
    return LayoutComparison(rows, first, params[:TOP_PARAMS], one_side, missing)


def param_diffs(
    base: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor], tolerance: float = 0.0
) -> tuple[list[ParamDiff], list[str]]:
    """Every parameter both records hold, the most different first; the names only one holds.
    Values beyond ``tolerance`` come first: a value that differs before the step is a cause
    (an initialisation, a missed update), a gradient that differs may be its effect."""
    names = _names(base) | _names(other)
    both = sorted(n for n in names if f"value/{n}" in base and f"value/{n}" in other)
    diffs = [
        ParamDiff(n, _diff(base, other, f"value/{n}"), _diff(base, other, f"grad/{n}"))
        for n in both
    ]
    diffs.sort(key=lambda d: (-_beyond(d.value, tolerance), -_nan_high(d.grad)))
    return diffs, sorted(names.difference(both))


def _names(tensors: Mapping[str, torch.Tensor]) -> set[str]:
    return {k.split("/", 1)[1] for k in tensors if k.startswith("value/")}


def _diff(base: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor], key: str) -> float:
    if key in base and key in other:
        return tensor_relative(base[key], other[key])
    return math.nan if key not in base and key not in other else math.inf


def _beyond(x: float, tolerance: float) -> float:
    x = _nan_high(x)
    return x if x > tolerance else 0.0


def _nan_high(x: float) -> float:
    """A NaN difference sorts as the largest: a NaN loss is never an agreement."""
    return math.inf if math.isnan(x) else x


def summary_lines(name: str, c: LayoutComparison, tolerance: float) -> Sequence[str]:
    """What ``meshrun compare`` prints for one layout."""
    lines = [f"layout {name}: " + _verdict(c, tolerance)]
    lines.append("  step  loss (1 process)   loss (layout)      rel. diff")
    lines += [f"  {s:>4}  {a:<17.10g}  {b:<17.10g}  {d:.1e}" for s, a, b, d in c.steps]
    if c.first_beyond is not None:
        lines += _param_lines(c)
    return lines


def _verdict(c: LayoutComparison, tolerance: float) -> str:
    largest = c.largest
    worst = (
        f"largest relative loss difference {largest[1]:.1e} (step {largest[0]})" if largest else ""
    )
    if c.first_beyond is not None:
        return f"DIFFERS from step {c.first_beyond} (tolerance {tolerance:g}); {worst}"
    if c.missing_steps:
        steps = ", ".join(map(str, c.missing_steps))
        return f"NO LOSS recorded for step {steps} (metrics.jsonl of either run)"
    return f"agrees (tolerance {tolerance:g}); {worst}"


def _param_lines(c: LayoutComparison) -> list[str]:
    if not c.params:
        return [
            f"  no parameters recorded at step {c.first_beyond}: the model is not "
            "run.parallelize's or run.pipeline's"
        ]
    lines = [f"  parameters differing most at step {c.first_beyond} (relative difference):"]
    width = max(len(p.name) for p in c.params)
    lines += [
        f"    {p.name:<{width}}  value {p.value:.1e}  gradient {p.grad:.1e}" for p in c.params
    ]
    if c.only_one_side:
        lines.append(f"  recorded by one run only: {', '.join(c.only_one_side[:TOP_PARAMS])}")
    return lines
