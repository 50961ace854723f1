"""``[fault_tolerance] diloco_*``: the refusals and the fragments, without processes (the
processes: tests/e2e/test_ft_diloco.py)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
from torch import nn
from torchft.local_sgd import DiLoCo

from meshrun.config import Config, ConfigError, load_config, split_overrides, validate_for_world
from meshrun.ft.diloco import DiLoCoSync, split_fragments


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
        (
            ["diloco_sync_every=6", "diloco_fragments=2", "diloco_fragment_sync_delay=3"],
            ["diloco_fragment_sync_delay = 3", "every 3 steps", "below 3", "e.g. 2"],
        ),
        (["diloco_fragment_sync_delay=1"], ["diloco_fragment_sync_delay = 1", "needs DiLoCo"]),
        (["diloco_fragment_update_alpha=0.5"], ["diloco_fragment_update_alpha = 0.5", "needs"]),
        (
            ["diloco_sync_every=4", "diloco_fragment_update_alpha=1.5"],
            ["diloco_fragment_update_alpha = 1.5", "[0, 1]"],
        ),
        (["diloco_sync_every=4", "diloco_fragment_sync_delay=-1"], ["diloco_fragment_sync_delay"]),
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


def test_streaming_delay_and_alpha_reach_torchft_and_saves_fall_on_window_boundaries() -> None:
    ft = Config().fault_tolerance
    assert (ft.diloco_fragment_sync_delay, ft.diloco_fragment_update_alpha) == (0, 0.0)
    keys = ["diloco_sync_every=8", "diloco_fragments=2", "replica_groups=2"]
    cfg = _cfg(*keys, "diloco_fragment_sync_delay=3", "diloco_fragment_update_alpha=0.5")
    assert cfg.fault_tolerance.diloco_fragment_sync_delay == 3
    validate_for_world(cfg, 1)  # no periodic saves: nothing to refuse
    # A fragment every 4 steps, its all-reduce in flight for the 3 before: a save every 6 steps
    # would land inside it at step 6; every 8 (or 4) lands on outer steps.
    cfg.checkpoint.interval = 6
    with pytest.raises(ConfigError, match=r"checkpoint.interval = 6 .*every 4 steps.*multiple"):
        validate_for_world(cfg, 1)
    cfg.checkpoint.interval = 8
    validate_for_world(cfg, 1)
    cfg.checkpoint.local_interval = 2
    with pytest.raises(ConfigError, match=r"checkpoint.local_interval = 2"):
        validate_for_world(cfg, 1)
    # Without a delay nothing is in flight between steps: any interval saves.
    cfg = _cfg(*keys, "diloco_fragment_update_alpha=0.5")
    cfg.checkpoint.interval = 3
    validate_for_world(cfg, 1)
    # torchft 0.2.0's DiLoCo takes both by these names (meshrun passes them through).
    params = inspect.signature(DiLoCo).parameters
    assert {"fragment_sync_delay", "fragment_update_alpha"} <= set(params)


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


def test_a_save_with_a_fragment_all_reduce_in_flight_says_when_to_save() -> None:
    """The runtime side of the interval check: a save at any other step (at the end, on a
    signal) inside the delay raises before anything is written. torchft's fragments stand in
    as the two attributes the check reads (no process group needed)."""
    cfg = _cfg("diloco_sync_every=8", "diloco_fragments=2", "diloco_fragment_sync_delay=3")
    sync = DiLoCoSync.__new__(DiLoCoSync)  # no ReplicaGroup: only the check runs
    sync.cfg = cfg.fault_tolerance
    sync.replicas = SimpleNamespace(state=SimpleNamespace(step=7))  # type: ignore[assignment]
    sync._diloco = SimpleNamespace(
        _fragments=[SimpleNamespace(_allreduce_work=[]), SimpleNamespace(_allreduce_work=[1])]
    )
    with pytest.raises(RuntimeError, match=r"step 7: .*in flight.*multiple of 4"):
        sync.state_dict()
    sync._diloco._fragments[1]._allreduce_work = []
    sync._check_nothing_in_flight()  # between windows: nothing to refuse
