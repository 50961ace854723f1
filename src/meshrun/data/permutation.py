"""A keyed pseudo-random permutation of ``[0, n)``, evaluated one index at a time.

``KeyedPermutation(n, key)(i)`` is the ``i``-th element of a shuffled ``range(n)``, computed
from ``(n, key, i)`` alone in O(1) expected time and memory: nothing of size ``n`` is ever
built, so the sampler's first batch costs the same for a thousand samples and for ten
billion, and every rank computes only the positions it reads.

**Construction.** Let ``k`` be the smallest number of bits with ``2**k >= n`` and
``M = 2**k`` (so ``M < 2n``). A ``k``-bit value is split into a high part ``L`` of ``a``
bits and a low part ``R`` of ``b = k - a`` bits (``a = ceil(k / 2)``). One Feistel round maps

    (L, R) -> (R, L xor F_r(R) mod 2**a)

and the next round splits the result the other way round (``b`` high bits, ``a`` low bits).
Each round is a bijection of ``[0, M)`` whatever ``F_r`` is: given the output ``(R, S)``,
the input is ``(S xor F_r(R) mod 2**a, R)``. A composition of bijections is a bijection, so
the ``ROUNDS``-round network ``E`` permutes ``[0, M)``. The round function is splitmix64's
finaliser of ``R xor K_r``, with round keys ``K_r`` hashed from ``(key, r)``; its top bits
are used, the best mixed ones. Six rounds: Luby and Rackoff's theorem needs three or four
for a pseudo-random permutation when the round functions are pseudo-random; the extra two
are margin for the unbalanced split (``a = b + 1`` when ``k`` is odd) and for a fast
non-cryptographic hash. A sample order needs statistical quality, not secrecy.

**Cycle walking** (Black and Rogaway, 2002) turns ``E`` on ``[0, M)`` into a permutation of
``[0, n)``: apply ``E`` to ``i`` until the value lands in ``[0, n)``. It stops because ``i``
lies on a cycle of ``E`` that returns to ``i`` itself; it is a bijection because the map
sends each point of ``[0, n)`` to the next point of ``[0, n)`` on its cycle, which walking
the cycle backwards undoes. **Cost**: the walks started from the ``n`` points of a cycle cover
the cycle's points exactly once between them, so over all ``i`` in ``[0, n)`` the total
number of applications of ``E`` is at most ``M`` (cycles holding no point of ``[0, n)`` are
never entered). The mean walk is therefore ``<= M / n < 2`` applications for every key, a
bound on the work per epoch, not just an expectation; a single walk's length has a
geometric tail (each step lands in ``[0, n)`` with probability ``n / M > 1/2``).

The vectorised path (``__call__`` on a NumPy array) and the scalar path (``at``, plain
Python integers: the reference) give the same values; tests check both.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

__all__ = ["KeyedPermutation", "mix_seed"]

MASK64 = (1 << 64) - 1
ROUNDS = 6
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
# Separates the order's round keys from every other stream hashed with mix_seed (the loader
# seeds workers with mix_seed(seed, rank, worker): without a tag, epoch e's round r would
# share its key with rank e's worker r).
_ORDER_TAG = 0x6F72646572  # "order"


def _finalise(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers with good avalanche."""
    x = ((x ^ (x >> 30)) * _M1) & MASK64
    x = ((x ^ (x >> 27)) * _M2) & MASK64
    return x ^ (x >> 31)


def _round_function(right: int, key: int, high: int) -> int:
    """The top ``high`` bits of splitmix64's finaliser of ``right xor key``, short of its last
    xorshift, which cannot change the top 31 bits (high <= 32 here, and bit 32 is as good)."""
    x = right ^ key
    x = ((x ^ (x >> 30)) * _M1) & MASK64
    x = ((x ^ (x >> 27)) * _M2) & MASK64
    return x >> (64 - high)


def mix_seed(*parts: int) -> int:
    """Hash integers into one 64-bit seed.

    Plain sums such as ``seed + epoch`` collide (seed 1 epoch 0 == seed 0
    epoch 1); splitmix64 gives unrelated streams for neighbouring inputs.
    """
    h = 0
    for part in parts:
        h = _finalise(((h ^ (part & MASK64)) + _GOLDEN) & MASK64)
    return h


def _round_function_array(right: NDArray[np.uint64], key: int, high: int) -> NDArray[np.uint64]:
    """``_round_function`` over an array; uint64 arithmetic wraps modulo 2**64 as wanted."""
    x = right ^ np.uint64(key)
    x ^= x >> np.uint64(30)
    x *= np.uint64(_M1)
    x ^= x >> np.uint64(27)
    x *= np.uint64(_M2)
    x >>= np.uint64(64 - high)
    return x


class KeyedPermutation:
    """A bijection of ``[0, n)`` chosen by ``key``; see the module docstring."""

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        self.bits = (n - 1).bit_length()  # 2**bits >= n > 2**(bits - 1)
        self._keys = [mix_seed(_ORDER_TAG, key, r) for r in range(ROUNDS)]
        high = (self.bits + 1) // 2
        # (high bits, low bits) of each round: the split alternates.
        self._splits = [
            (high, self.bits - high) if r % 2 == 0 else (self.bits - high, high)
            for r in range(ROUNDS)
        ]

    def at(self, i: int) -> int:
        """The ``i``-th element, in plain Python integers."""
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} is outside [0, {self.n})")
        x = self._encrypt(i)
        while x >= self.n:
            x = self._encrypt(x)
        return x

    def __call__(self, i: NDArray[np.integer]) -> NDArray[np.uint64]:
        """Elements ``i`` (any integer array of values in ``[0, n)``), as uint64."""
        x = np.asarray(i).astype(np.uint64)
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.n):
            raise IndexError(f"indices must lie in [0, {self.n})")
        out = self._encrypt_array(x)
        todo = np.flatnonzero(out >= self.n)
        while todo.size:  # cycle walking: < 2 applications per element on average
            again = self._encrypt_array(out[todo])
            out[todo] = again
            todo = todo[again >= self.n]
        return out

    def _encrypt(self, x: int) -> int:
        for key, (high, low) in zip(self._keys, self._splits, strict=True):
            left, right = x >> low, x & ((1 << low) - 1)
            f = _round_function(right, key, high) if high else 0
            x = (right << high) | (left ^ f)
        return x

    def _encrypt_array(self, x: NDArray[np.uint64]) -> NDArray[np.uint64]:
        for key, (high, low) in zip(self._keys, self._splits, strict=True):
            right = x & np.uint64((1 << low) - 1)
            left = x >> np.uint64(low)
            if high:
                left ^= _round_function_array(right, key, high)
            right <<= np.uint64(high)
            right |= left
            x = right
        return x
