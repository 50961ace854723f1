"""ResumableSampler: world-size-independent order, spill-over epochs, resume, eval; the keyed
per-index order and the rule for checkpoints saved by the earlier (randperm) sampler."""

from __future__ import annotations

import itertools
import tracemalloc
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from meshrun.data import ResumableSampler
from meshrun.data.permutation import KeyedPermutation
from meshrun.data.sampler import mix_seed

N = 30  # not a multiple of G, so the last global batch of each epoch spills over
G = 12


def make_ranks(world_size: int, num_samples: int = N, **kw: Any) -> list[ResumableSampler]:
    kw.setdefault("global_batch", G)
    return [
        ResumableSampler(num_samples, rank=r, world_size=world_size, **kw)
        for r in range(world_size)
    ]


def interleave(per_rank: list[list[int]], global_batch: int = G) -> list[int]:
    """Put each rank's indices back at their stream positions (rank r: p + r + k*D)."""
    world = len(per_rank)
    local = global_batch // world
    total = sum(len(x) for x in per_rank)
    order = [-1] * total
    for r, indices in enumerate(per_rank):
        for i, index in enumerate(indices):
            batch, k = divmod(i, local)
            order[batch * global_batch + r + k * world] = index
    return order


def one_pass(samplers: list[ResumableSampler]) -> list[int]:
    return interleave([list(s) for s in samplers], samplers[0].global_batch)


class Lockstep:
    """All ranks of one job, stepping one global batch at a time like a training loop."""

    def __init__(self, samplers: list[ResumableSampler]) -> None:
        self.samplers = samplers
        self.iters: list[Iterator[int]] = [iter(s) for s in samplers]

    def run(self, num_batches: int) -> list[int]:
        out: list[int] = []
        for _ in range(num_batches):
            out += self._next_batch()
            for s in self.samplers:
                s.step()
        return out

    def _next_batch(self) -> list[int]:
        local = self.samplers[0].global_batch // len(self.samplers)
        chunks = [list(itertools.islice(it, local)) for it in self.iters]
        if not chunks[0]:  # end of this pass: start the next one, as a DataLoader would
            self.iters = [iter(s) for s in self.samplers]
            chunks = [list(itertools.islice(it, local)) for it in self.iters]
        return interleave(chunks, self.samplers[0].global_batch)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_epoch_covers_every_index_once_on_any_world_size(world_size: int) -> None:
    samplers = make_ranks(world_size)
    counts = [len(list(s)) for s in make_ranks(world_size)]
    order = one_pass(samplers)
    assert sorted(order[:N]) == list(range(N))
    assert len(order) == 36  # three global batches; the third spills 6 into epoch 1
    assert len(set(order[N:])) == len(order[N:])
    assert counts == [36 // world_size] * world_size
    assert [len(s) for s in make_ranks(world_size)] == counts
    assert order == one_pass(make_ranks(1))


def test_global_batch_holds_same_samples_for_every_world_size() -> None:
    for world_size in (2, 3, 4):
        order = one_pass(make_ranks(world_size))
        reference = one_pass(make_ranks(1))
        for start in range(0, len(order), G):
            assert set(order[start : start + G]) == set(reference[start : start + G])


def test_rank_takes_strided_positions_of_each_global_batch() -> None:
    reference = one_pass(make_ranks(1))
    rank1 = list(make_ranks(3)[1])
    assert rank1[:4] == [reference[p] for p in (1, 4, 7, 10)]


def test_epochs_differ_and_advance_without_step() -> None:
    (s,) = make_ranks(1)
    first = list(s)
    assert s.consumed == 36 and s.epoch == 1
    second = list(s)  # positions 36..59: the rest of epoch 1, ending exactly on its end
    assert s.consumed == 60 and s.epoch == 2
    epoch0, epoch1 = first[:N], first[N:] + second
    assert sorted(epoch1) == list(range(N))
    assert epoch0 != epoch1
    third = list(s)
    assert sorted(third[:N]) == list(range(N)) and third[:N] not in (epoch0, epoch1)


def test_unshuffled_order_is_the_dataset_order() -> None:
    (s,) = make_ranks(1, shuffle=False)
    assert list(s) == [*range(N), *range(6)]


def test_step_during_iteration_overrides_automatic_advance() -> None:
    (s,) = make_ranks(1)
    for i, _ in enumerate(s):
        if i == 0:
            s.step()
    assert s.consumed == G


def test_step_after_prefetched_pass_belongs_to_that_pass() -> None:
    # A DataLoader with workers can exhaust the sampler before training steps.
    (s,) = make_ranks(1)
    list(s)
    s.step()
    s.step()
    assert s.consumed == 2 * G  # training is two steps into the prefetched pass
    s.step()
    assert s.consumed == 36


def test_len_counts_what_iteration_yields_mid_epoch() -> None:
    samplers = make_ranks(2)
    for s in samplers:
        s.step()
        s.step(G * 2)
    assert samplers[0].consumed == 36
    assert [len(s) for s in samplers] == [len(list(s)) for s in samplers] == [12, 12]


def test_resume_on_other_world_sizes_continues_the_stream() -> None:
    reference = Lockstep(make_ranks(4, num_samples=50)).run(12)

    first = make_ranks(4, num_samples=50)
    got = Lockstep(first).run(3)
    state = first[0].state_dict()
    assert all(type(v) is int for v in state.values())
    assert state["consumed"] == 3 * G

    second = make_ranks(2, num_samples=50)
    for s in second:
        s.load_state_dict(state)
    got += Lockstep(second).run(5)  # crosses the epoch 0 -> 1 boundary (spill)

    third = make_ranks(3, num_samples=50)
    for s in third:
        s.load_state_dict(second[1].state_dict())
    got += Lockstep(third).run(4)
    assert got == reference


def test_resume_after_plain_pass_continues_next_epoch() -> None:
    (s,) = make_ranks(1)
    list(s)
    resumed = make_ranks(2)
    for r in resumed:
        r.load_state_dict(s.state_dict())
    assert one_pass(resumed) == list(s)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_eval_covers_each_index_exactly_once(world_size: int, shuffle: bool) -> None:
    samplers = make_ranks(world_size, num_samples=10, global_batch=7, mode="eval", shuffle=shuffle)
    per_rank = [list(s) for s in samplers]
    flat = [i for chunk in per_rank for i in chunk]
    assert sorted(flat) == list(range(10))
    counts = [len(c) for c in per_rank]
    assert max(counts) - min(counts) <= 1
    assert [len(s) for s in samplers] == counts
    assert per_rank == [list(s) for s in samplers]  # no epoch advance in eval


def test_eval_shuffled_order_matches_train_epoch_zero() -> None:
    train = list(make_ranks(1)[0])[:N]
    evaluation = interleave([list(s) for s in make_ranks(3, mode="eval")], N)
    assert evaluation == train


def test_step_in_eval_mode_is_an_error() -> None:
    (s,) = make_ranks(1, mode="eval")
    with pytest.raises(RuntimeError, match="eval"):
        s.step()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 5}, r"global_batch \(12\).*world_size \(5\)"),
        ({"rank": 2, "world_size": 2}, "rank must be in"),
        ({"rank": -1}, "rank must be in"),
        ({"num_samples": 0}, "num_samples"),
        ({"global_batch": 0}, "global_batch"),
        ({"mode": "test"}, "mode"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"rank": 0, "world_size": 1, "global_batch": G, "num_samples": N}
    args.update(kwargs)
    num_samples = args.pop("num_samples")
    with pytest.raises(ValueError, match=match):
        ResumableSampler(num_samples, **args)


@pytest.mark.parametrize(
    ("key", "other"),
    [("seed", {"seed": 7}), ("num_samples", {"num_samples": 31}), ("shuffle", {"shuffle": False})],
)
def test_load_rejects_a_different_stream(key: str, other: dict[str, Any]) -> None:
    source = make_ranks(1, **other)[0]
    target = make_ranks(1)[0]
    mine, theirs = target.state_dict()[key], source.state_dict()[key]
    with pytest.raises(ValueError, match=rf"'{key}'.*{theirs}.*{mine}"):
        target.load_state_dict(source.state_dict())


def test_load_accepts_a_different_global_batch() -> None:
    source = make_ranks(1, global_batch=6)[0]
    source.step()
    target = make_ranks(1)[0]
    target.load_state_dict(source.state_dict())
    assert target.consumed == 6


# -- the keyed per-index order ----------------------------------------------------------------


@pytest.mark.parametrize("num_samples", [1, 2, 3, 1000, 65537])
@pytest.mark.parametrize("world_size", range(1, 9))
def test_every_world_size_sees_each_sample_once_per_epoch(
    num_samples: int, world_size: int
) -> None:
    # G = 3D: for N = 1, 2 a global batch spans several epochs; for the others the last batch
    # of the epoch spills into the next one. Either way the first N positions of the pass are
    # epoch 0 (each sample once) and the rest begin epoch 1, identical for every D.
    g = 3 * world_size
    samplers = make_ranks(world_size, num_samples=num_samples, global_batch=g)
    per_rank = [list(s) for s in samplers]
    assert len({len(x) for x in per_rank}) == 1  # every rank the same count
    order = interleave(per_rank, g)
    assert len(order) == -(-num_samples // g) * g
    assert sorted(order[:num_samples]) == list(range(num_samples))
    assert order == stream(num_samples, len(order))


def stream(num_samples: int, length: int, seed: int = 0) -> list[int]:
    """The first ``length`` positions of the stream, read by one rank one epoch at a time."""
    (s,) = make_ranks(1, num_samples=num_samples, global_batch=1, seed=seed)
    out: list[int] = []
    while len(out) < length:
        out += list(s)  # a whole pass with G = 1: exactly one epoch
    return out[:length]


@pytest.mark.parametrize("num_samples", [97, 1000])  # G > N: batches span 2-3 epochs
@pytest.mark.parametrize(("before", "after"), [(1, 8), (8, 3), (4, 6), (7, 2)])
def test_resume_on_another_world_size_continues_exactly(
    num_samples: int, before: int, after: int
) -> None:
    g = 168  # divisible by 1..8
    reference = Lockstep(make_ranks(1, num_samples=num_samples, global_batch=g)).run(15)
    first = make_ranks(before, num_samples=num_samples, global_batch=g)
    got = Lockstep(first).run(7)  # 1176 positions: inside epoch 1 for N = 1000
    second = make_ranks(after, num_samples=num_samples, global_batch=g)
    for s in second:
        s.load_state_dict(first[before - 1].state_dict())
    got += Lockstep(second).run(8)
    assert got == reference


def test_epochs_and_seeds_give_different_orders() -> None:
    epochs = {seed: stream(1000, 3000, seed) for seed in (0, 1)}
    orders = {
        (seed, e): tuple(epochs[seed][e * 1000 : (e + 1) * 1000])
        for seed in (0, 1)
        for e in range(3)
    }
    assert len(set(orders.values())) == len(orders)
    for order in orders.values():
        assert sorted(order) == list(range(1000))
        # Not a shift or a near-identity: few samples keep their place.
        assert sum(i == p for p, i in enumerate(order)) < 10


def _first(num_samples: int, seed: int, epoch: int, count: int) -> list[int]:
    s = ResumableSampler(num_samples, rank=0, world_size=1, global_batch=8, seed=seed)
    s.load_state_dict({**s.state_dict(), "consumed": epoch * num_samples})
    return list(itertools.islice(iter(s), count))


def test_the_order_is_pinned() -> None:
    # Changing the keyed order changes every resumed run's data: it needs a new order
    # version (see sampler.py), never an edit that slips through.
    assert _first(1000, 0, 0, 8) == [758, 890, 887, 864, 100, 974, 940, 934]
    assert _first(10**10, 3, 5, 4) == [6845004412, 7095334429, 3048372995, 4226144070]


def test_a_huge_dataset_costs_what_a_small_one_does() -> None:
    # Memory is counted, not timed: NumPy reports its buffers to tracemalloc.
    def peak(num_samples: int) -> int:
        s = ResumableSampler(num_samples, rank=3, world_size=8, global_batch=512, seed=1)
        s.load_state_dict({**s.state_dict(), "consumed": 7 * num_samples - 100})
        tracemalloc.start()
        batch = list(itertools.islice(iter(s), 64))
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert len(set(batch)) == 64 and all(0 <= i < num_samples for i in batch)
        return top

    small, huge = peak(10**4), peak(10**12)
    assert huge < small + 64 * 1024, (small, huge)


def test_the_keyed_order_never_draws_a_whole_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("torch.randperm called")

    monkeypatch.setattr(torch, "randperm", refuse)
    (s,) = make_ranks(1, num_samples=1000)
    assert len(list(s)) == 1008


# -- checkpoints saved by the earlier sampler ---------------------------------------------------


def legacy_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The earlier sampler's epoch: torch.randperm seeded with mix_seed(seed, epoch)."""
    gen = torch.Generator().manual_seed(mix_seed(seed, epoch))
    return torch.randperm(num_samples, generator=gen).tolist()


def legacy_state(consumed: int, **kw: Any) -> dict[str, int]:
    """A state dict as the earlier sampler wrote it: the same keys, no 'order'."""
    state = make_ranks(1, **kw)[0].state_dict()
    del state["order"]
    return {**state, "consumed": consumed}


def test_a_state_without_order_resumes_the_earlier_order_exactly() -> None:
    stream = [i for epoch in range(4) for i in legacy_order(N, 0, epoch)]
    resumed = make_ranks(3)
    with pytest.warns(UserWarning, match="torch.randperm"):
        for s in resumed:
            s.load_state_dict(legacy_state(24))  # mid-epoch 0; the pass spills into epoch 1
    got = Lockstep(resumed).run(4)
    assert got == stream[24 : 24 + 4 * G]
    state = resumed[0].state_dict()
    assert state["order"] == 1  # its next checkpoint keeps the run on the earlier order
    again = make_ranks(2)
    with pytest.warns(UserWarning, match="torch.randperm"):
        for s in again:
            s.load_state_dict(state)
    assert Lockstep(again).run(2) == stream[72 : 72 + 2 * G]


def test_an_unshuffled_state_without_order_loads_quietly() -> None:
    (s,) = make_ranks(1, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.load_state_dict(legacy_state(6, shuffle=False))
    assert list(s)[:3] == [6, 7, 8]


def test_a_new_state_keeps_the_keyed_order() -> None:
    source = make_ranks(1)[0]
    source.step()
    target = make_ranks(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.load_state_dict(source.state_dict())
    assert target.state_dict()["order"] == 2
    assert list(target) == list(source)


def test_an_unknown_order_is_refused() -> None:
    (s,) = make_ranks(1)
    with pytest.raises(ValueError, match=r"'order' is 3.*newer meshrun"):
        s.load_state_dict({**s.state_dict(), "order": 3})
    assert s.consumed == 0 and s.state_dict()["order"] == 2


# -- the permutation itself ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 1000, 1024, 1025, 65537])
def test_keyed_permutation_is_a_bijection_and_both_paths_agree(n: int) -> None:
    for key in (0, 1, 2**63 + 5):
        perm = KeyedPermutation(n, key)
        fast = perm(np.arange(n)).tolist()
        assert sorted(fast) == list(range(n))
        assert fast[:2000] == [perm.at(i) for i in range(min(n, 2000))]


@pytest.mark.parametrize("n", [10**10, 2**40 + 3, 2**64 - 1])
def test_both_paths_agree_on_huge_domains(n: int) -> None:
    # Odd and even bit counts, up to the 64 bits the uint64 path holds.
    perm = KeyedPermutation(n, 9)
    at = np.random.default_rng(0).integers(0, min(n, 2**63 - 1), 300, dtype=np.int64)
    at[:3] = [0, 1, min(n, 2**63 - 1) - 1]
    fast = perm(at).tolist()
    assert fast == [perm.at(int(i)) for i in at]
    assert len(set(fast)) == len(fast) and all(0 <= v < n for v in fast)


@pytest.mark.parametrize("n", [3, 5, 1000, 1025, 4097])  # 2**k + 1: the worst ratio
def test_cycle_walking_costs_under_two_applications_per_index(n: int) -> None:
    # Over [0, n) the walks cover each cycle's points at most once: <= 2**bits < 2n in all.
    calls = 0

    class Counting(KeyedPermutation):
        def _encrypt(self, x: int) -> int:
            nonlocal calls
            calls += 1
            return super()._encrypt(x)

    perm = Counting(n, 11)
    for i in range(n):
        perm.at(i)
    assert n <= calls <= 2**perm.bits < 2 * n


def test_keyed_permutation_looks_uniform() -> None:
    # Deterministic (fixed keys), so not flaky: where 2000 keys send index 0 of 1000, and the
    # correlation of neighbouring outputs in one long order.
    firsts = np.bincount([KeyedPermutation(1000, k).at(0) for k in range(4000)], minlength=1000)
    expected = 4.0
    chi2_per_dof = float(((firsts - expected) ** 2 / expected).sum()) / 999
    assert 0.8 < chi2_per_dof < 1.2
    out = KeyedPermutation(10**9, 4)(np.arange(50_000)).astype(np.float64)
    assert abs(np.corrcoef(out[:-1], out[1:])[0, 1]) < 0.02
    assert abs(np.corrcoef(np.arange(50_000), out)[0, 1]) < 0.02


def test_keyed_permutation_rejects_what_is_outside_its_domain() -> None:
    with pytest.raises(ValueError, match="n >= 1"):
        KeyedPermutation(0, 1)
    perm = KeyedPermutation(10, 1)
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        perm.at(10)
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        perm(np.array([3, 10]))
