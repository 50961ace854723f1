"""``[fault_tolerance] diloco_*``: the refusals and the fragments, without processes (the
processes: tests/e2e/test_ft_diloco.py)."""

from __future__ import annotations

import pytest
from torch import nn

from meshrun.config import Config, ConfigError, load_config, split_overrides, validate_for_world
from meshrun.ft.diloco import split_fragments


def _cfg(*args: str) -> Config:
    return load_config(None, split_overrides([f"--fault_tolerance.{a}" for a in args])[0])


def test_off_by_default_with_the_papers_outer_optimizer() -> None:
    ft = Config().fault_tolerance
    assert not ft.diloco and ft.diloco_sync_every == 0 and ft.diloco_fragments == 1
    assert (ft.diloco_outer_lr, ft.diloco_outer_momentum, ft.diloco_nesterov) == (0.7, 0.9, True)
    assert not ft.diloco_quantize


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["diloco_sync_every=5", "diloco_fragments=2"], ["diloco_fragments = 2", "multiple"]),
        (["diloco_sync_every=2", "diloco_fragments=4"], ["diloco_sync_every = 4"]),
        (["diloco_fragments=2"], ["needs DiLoCo", "diloco_sync_every > 0"]),
        (["diloco_outer_lr=0"], ["diloco_outer_lr = 0.0", "> 0"]),
        (["diloco_outer_momentum=1"], ["diloco_outer_momentum = 1.0", "[0, 1)"]),
        (["diloco_outer_momentum=0"], ["diloco_nesterov = true", "diloco_nesterov = false"]),
        (["diloco_quantize=true"], ["diloco_quantize = true", "Triton", "Gloo"]),
        (["diloco_sync_every=-1"], ["diloco_sync_every"]),
    ],
)
def test_bad_values_name_the_key_and_the_fix(args: list[str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        _cfg(*args)
    for word in words:
        assert word in str(err.value)


def test_one_group_is_refused_with_the_world_and_two_pass() -> None:
    with pytest.raises(ConfigError, match=r"replica_groups = 1.*--replica-groups N"):
        validate_for_world(_cfg("diloco_sync_every=4"), 1)
    validate_for_world(_cfg("diloco_sync_every=4", "replica_groups=2"), 1)
    cfg = _cfg("diloco_sync_every=1", "diloco_outer_momentum=0", "diloco_nesterov=false")
    assert cfg.fault_tolerance.diloco_outer_momentum == 0


def test_fragments_are_contiguous_runs_of_about_equal_size() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 1))
    names = [n for n, _ in model.named_parameters()]
    for n in (1, 2, 3, 6):
        frags = split_fragments([model], n)
        got = [name for f in frags for name, _ in f.named_parameters()]
        assert len(frags) == n and got == names  # every parameter once, in order
        assert all(list(f.parameters()) for f in frags)
    sizes = [sum(p.numel() for p in f.parameters()) for f in split_fragments([model], 2)]
    assert sizes == [16 * 32 + 32, 32 * 32 + 32 + 32 + 1]
    with pytest.raises(RuntimeError, match=r"diloco_fragments = 7.*6 parameter tensors"):
        split_fragments([model], 7)
