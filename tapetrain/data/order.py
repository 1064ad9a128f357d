"""Global sample order: global slot g -> dataset index, a pure function of (seed, g).

Slot g belongs to epoch e = g // n and position p = g % n; the index is perm_e[p], where perm_e is a
permutation of range(n) seeded by (seed, e). For n <= MAX_CACHED_PERMUTATION perm_e is a numpy permutation
(Generator(PCG64(SeedSequence([seed, e]))).permutation(n)), computed once per epoch and cached (4 bytes per
sample). Larger n use a keyed Feistel bijection with cycle walking: O(1) memory, computed per slot.
"""

from __future__ import annotations

import numpy as np

from tapetrain.data.hashing import keyed_hash

MAX_CACHED_PERMUTATION = 1 << 25  # 32Mi samples -> 128 MiB of uint32 per cached epoch


class FeistelPermutation:
    """Bijection of range(n) keyed by (seed, epoch): 6-round Feistel on 2*h bits, cycle-walked into [0, n)."""

    ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int):
        self.n, self.seed, self.epoch = n, seed, epoch
        bits = max(2, int(n - 1).bit_length())
        self.half = (bits + 1) // 2  # domain 4**half is in [n, 4n): cycle walking takes < 4 steps on average
        self.mask = np.uint64((1 << self.half) - 1)

    def _once(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for r in range(self.ROUNDS):
            f = keyed_hash(right, self.seed, stream=self.epoch * self.ROUNDS + r + 1) & self.mask
            left, right = right, left ^ f
        return (left << h) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = self._once(np.asarray(positions, dtype=np.uint64))
        out_of_range = x >= self.n
        while out_of_range.any():  # cycle walking: re-apply until inside [0, n); stays a bijection of [0, n)
            x[out_of_range] = self._once(x[out_of_range])
            out_of_range = x >= self.n
        return x.astype(np.int64)


class SampleOrder:
    """Callable: int64 array of global slots -> int64 array of dataset indices in [0, num_samples)."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = int(num_samples), int(seed), shuffle
        self._cache: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int):
        if epoch not in self._cache:
            if len(self._cache) >= 2:  # keep the current and the next epoch around a boundary
                self._cache.pop(min(self._cache))
            if self.n <= MAX_CACHED_PERMUTATION:
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
                self._cache[epoch] = rng.permutation(self.n).astype(np.uint32)
            else:
                perm = FeistelPermutation(self.n, self.seed, epoch)
                self._cache[epoch] = perm  # type: ignore[assignment]
        return self._cache[epoch]

    def __call__(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64)
        epochs, positions = np.divmod(slots, self.n)
        if not self.shuffle:
            return positions
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            perm = self._permutation(int(epoch))
            out[sel] = perm(positions[sel]) if callable(perm) else perm[positions[sel]]
        return out
