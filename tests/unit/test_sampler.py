"""ResumableSampler: world-size-independent order, spill-over epochs, resume, eval."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from meshrun.data import ResumableSampler

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
