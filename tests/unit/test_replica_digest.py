"""The replica check's pure parts (monitor/replicas_check.py): the digest sees any single
flipped bit, in any dtype; the mismatch names the minority, or every replica without one."""

import pytest
import torch

from meshrun.config import Config, ConfigError, apply_overrides
from meshrun.monitor.replicas_check import _clean, digest, find_mismatches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float16])
def test_every_single_bit_flip_changes_the_digest(dtype: torch.dtype) -> None:
    t = torch.randn(7, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    base = digest(t)
    assert digest(t.clone()) == base  # exact and repeatable
    raw = t.view(-1).view(torch.uint8)  # every bit of every byte, one at a time
    for i in range(raw.numel()):
        for bit in range(8):
            flipped = t.clone()
            flipped.view(-1).view(torch.uint8)[i] ^= 1 << bit
            assert digest(flipped) != base, (i, bit)
    assert raw.numel() % 4 or dtype != torch.float16  # 21 halves: read as bytes


def test_swapped_words_change_the_weighted_sum() -> None:
    t = torch.tensor([1.0, 2.0, 3.0])
    assert digest(t)[0] == digest(t[[1, 0, 2]])[0] and digest(t) != digest(t[[1, 0, 2]])


def test_the_minority_is_named_or_every_replica_without_a_majority() -> None:
    names = ["a.weight", "b.bias"]
    good, bad = [1, 2, 3, 4], [1, 2, 3, 5]
    found = find_mismatches(names, [good, bad, good], [0, 4, 8], ["h0", "h1", "h2"])
    assert [(m.name, m.ranks, m.hosts, m.majority) for m in found] == [
        ("b.bias", (4,), ("h1",), True)
    ]
    assert found[0].text() == "'b.bias': rank 4 on h1 differ(s) from the other replicas"
    (tie,) = find_mismatches(names, [good, bad], [0, 1], ["h0", "h1"])
    assert tie.ranks == (0, 1) and not tie.majority
    assert "rank 0 on h0, rank 1 on h1 disagree (no majority" in tie.text()
    assert find_mismatches(names, [good, good], [0, 1], ["h0", "h1"]) == []


def test_wrapper_prefixes_leave_the_users_names() -> None:
    assert _clean("module._orig_mod.blocks.0.submodule.weight") == "blocks.0.submodule.weight"
    assert _clean("module") == "module"


def test_the_check_interval_is_a_monitor_key() -> None:
    assert Config().monitor.replica_check_every == 0  # off unless asked
    cfg = apply_overrides(Config(), [("monitor.replica_check_every", "100")])
    assert cfg.monitor.replica_check_every == 100
    with pytest.raises(ConfigError, match=r"monitor\.replica_check_every"):
        apply_overrides(Config(), [("monitor.replica_check_every", "-1")])
