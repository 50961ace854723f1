"""The step loop is built whole from one frozen ``Machinery`` (train/machinery.py), which
train/startup.py builds once: no part of the loop is assigned after construction."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from meshrun.train.loop import StepLoop
from meshrun.train.machinery import Machinery


def test_the_step_loop_takes_one_machinery_and_nothing_else() -> None:
    params = inspect.signature(StepLoop).parameters.values()
    assert [(p.name, p.annotation) for p in params] == [("parts", "Machinery")]


def test_the_machinery_is_frozen_and_the_loop_has_no_slots_to_fill_later() -> None:
    assert Machinery.__dataclass_params__.frozen  # type: ignore[attr-defined]
    # A class-level default (``seed = 0``, ``diloco = None``) is a slot someone fills after
    # construction: the two-phase pattern this replaced.
    slots = [
        name
        for name, value in vars(StepLoop).items()
        if not name.startswith("__") and not callable(value) and not isinstance(value, property)
    ]
    assert slots == []


def test_unresolved_batch_figures_are_refused_with_the_fix() -> None:
    figures = {"accum": 1, "global_batch": 0, "micro_batch": 4}
    others = {f.name: None for f in dataclasses.fields(Machinery) if f.name not in figures} | {
        "device": torch.device("cpu")
    }
    with pytest.raises(ValueError, match=r"global_batch=0.*resolve_global_batch"):
        Machinery(**figures, **others)  # type: ignore[arg-type]
