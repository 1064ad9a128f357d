"""Counter-based hashing: stateless, vectorized, identical on every machine and numpy version.

Used where a random decision must be a pure function of (seed, index): the per-document train/val split and
the round function of the large-epoch sample permutation.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SEED_MUL = 0xD1B54A32D192ED03
_MASK64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer of uint64 array x (wrapping arithmetic) -> uint64 array of the same shape."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def keyed_hash(keys: np.ndarray, seed: int, stream: int = 0) -> np.ndarray:
    """Hash of (seed, stream, key) for each key -> uint64; different streams give independent hashes."""
    salt = np.uint64(((seed * _SEED_MUL) ^ (stream * 0x2545F4914F6CDD1D) ^ (seed >> 64)) & _MASK64)
    with np.errstate(over="ignore"):
        return splitmix64(splitmix64(np.asarray(keys, dtype=np.uint64) ^ salt) + salt)


def uniform01(keys: np.ndarray, seed: int, stream: int = 0) -> np.ndarray:
    """Deterministic uniform floats in [0, 1) for each key (53 random bits)."""
    return (keyed_hash(keys, seed, stream) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
