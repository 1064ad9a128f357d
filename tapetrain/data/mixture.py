"""Weighted mixture of datasets with O(1), deterministic index -> (source, source index) mapping.

Weights are normalized and turned into integer quotas q_s per cycle (resolution 1/10000, at least 1 each,
divided by their gcd); a cycle of C = sum(q_s) consecutive mixture indices holds exactly q_s samples of source
s, in an order fixed by `seed`. Mixture index j is in cycle c = j // C at position p = j % C; if that position
is the r-th of source s in the cycle, j maps to source s, sample (c * q_s + r) % n_s. So every source is read
in order, wrapping around (upsampling) when its share exceeds its size. num_samples is the smallest whole
number of cycles in which every source is read completely at least once: cycles = max_s ceil(n_s / q_s).
The consumer (BatchIterator) shuffles mixture indices, so the within-cycle order only matters unshuffled.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tapetrain.data.errors import DataError

WEIGHT_RESOLUTION = 10_000


class MixedDataset:
    """Weighted mixture of several PackedDatasets, deterministic from seed; same interface (num_samples,
    __getitem__, vocab_size, seq_len) as PackedDataset."""

    def __init__(self, sources: list[tuple[Any, float]], seed: int):
        if not sources:
            raise DataError("a data mixture needs at least one source; list {'path': ..., 'weight': ...}")
        self.datasets = [ds for ds, _ in sources]
        for ds, w in sources:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                raise DataError(f"mixture weight {w!r} for {getattr(ds, 'path', ds)} must be a positive "
                                "number, e.g. 0.3")
        weights = np.array([float(w) for _, w in sources])
        first = self.datasets[0]
        for ds in self.datasets[1:]:
            if ds.seq_len != first.seq_len or ds.vocab_size != first.vocab_size:
                raise DataError(
                    f"mixture sources disagree: {getattr(first, 'path', first)} has vocab_size="
                    f"{first.vocab_size} seq_len={first.seq_len} but {getattr(ds, 'path', ds)} has "
                    f"vocab_size={ds.vocab_size} seq_len={ds.seq_len}; prepare all sources with the same "
                    "tokenizer"
                )
        self.seq_len, self.vocab_size = first.seq_len, first.vocab_size
        self.collate = getattr(first, "collate", None)  # supervised examples batch through their own collate
        self.document_mask = bool(getattr(first, "document_mask", False))  # the same option opened every source
        quotas = np.maximum(1, np.rint(weights / weights.sum() * WEIGHT_RESOLUTION)).astype(np.int64)
        quotas //= np.gcd.reduce(quotas)
        self.quotas = quotas
        self.weights = quotas / quotas.sum()  # effective weights after rounding
        self.cycle = int(quotas.sum())
        # owner[p]: source of cycle position p (seeded shuffle); rank[p]: how many earlier positions it owns.
        owner = np.repeat(np.arange(len(quotas)), quotas)
        np.random.default_rng(seed).shuffle(owner)
        rank = np.empty_like(owner)
        for s in range(len(quotas)):
            where = np.flatnonzero(owner == s)
            rank[where] = np.arange(len(where))
        self._owner, self._rank = owner, rank
        self._sizes = np.array([ds.num_samples for ds in self.datasets], dtype=np.int64)
        cycles = int(max(-(-n // q) for n, q in zip(self._sizes, quotas, strict=True)))
        self.num_samples = cycles * self.cycle

    def __len__(self) -> int:
        return self.num_samples

    def locate(self, index: int) -> tuple[int, int]:
        """Mixture index -> (source number, index within that source)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"mixture index {index} out of range [0, {self.num_samples})")
        c, p = divmod(int(index), self.cycle)
        s = int(self._owner[p])
        return s, int((c * self.quotas[s] + self._rank[p]) % self._sizes[s])

    def __getitem__(self, index: int) -> np.ndarray:
        s, i = self.locate(index)
        return self.datasets[s][i]

    @property
    def fetches_remote(self) -> bool:
        return any(getattr(ds, "fetches_remote", False) for ds in self.datasets)

    def close(self) -> None:
        for ds in self.datasets:
            close = getattr(ds, "close", None)
            if close is not None:
                close()

    def prefetch(self, indices: np.ndarray) -> None:
        """Hand each source the indices of its own that the mixture indices `indices` map to."""
        found: dict[int, list[int]] = {}
        for index in indices:
            s, i = self.locate(int(index))
            found.setdefault(s, []).append(i)
        for s, own in found.items():
            prefetch = getattr(self.datasets[s], "prefetch", None)
            if prefetch is not None:
                prefetch(np.asarray(own, dtype=np.int64))
