"""Seeded percentile-bootstrap confidence intervals of the eval results (numpy only).

Perplexity resamples windows: each resample draws as many windows as were scored, with replacement, and takes
exp(Σ NLL / Σ tokens) of the draw (the token-weighted PPL of the protocol). Accuracies resample trials: the mean
of a draw of as many 0/1 (or fractional) scores as there were; with strata (RULER's tasks) each stratum is
resampled on its own and the strata's means averaged, as the point estimate is. The interval is the
(α/2, 1 − α/2) percentiles of the resampled statistics; one seed makes every interval repeatable.
"""

from __future__ import annotations

import numpy as np

DEFAULT_RESAMPLES = 1000
DEFAULT_LEVEL = 0.95
CHUNK_DRAWS = 1 << 22


def _bounds(samples: np.ndarray, level: float) -> tuple[float, float]:
    low, high = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def ppl_interval(window_nll: list[float], window_tokens: list[int], resamples: int = DEFAULT_RESAMPLES,
                 seed: int = 0, level: float = DEFAULT_LEVEL) -> tuple[float, float]:
    """CI of exp(Σ nll / Σ tokens) over windows resampled with replacement."""
    nll, tokens = np.asarray(window_nll, dtype=np.float64), np.asarray(window_tokens, dtype=np.float64)
    if len(nll) != len(tokens) or not len(nll):
        raise ValueError(f"{len(nll)} window NLLs for {len(tokens)} token counts")
    rng = np.random.default_rng(seed)
    chunk = max(1, CHUNK_DRAWS // len(nll))  # resamples per block: (chunk, windows) indices stay ~32 MB
    stats = []
    for first in range(0, resamples, chunk):
        draws = rng.integers(0, len(nll), size=(min(chunk, resamples - first), len(nll)))  # (chunk, windows)
        stats.append(np.exp(nll[draws].sum(axis=1) / tokens[draws].sum(axis=1)))
    stats = np.concatenate(stats)
    return _bounds(stats, level)


def mean_interval(scores: list[float], resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                  level: float = DEFAULT_LEVEL, strata: list[str] | None = None) -> tuple[float, float]:
    """CI of the mean score (of the strata's means, with `strata`) over trials resampled with replacement."""
    values = np.asarray(scores, dtype=np.float64)
    if not len(values):
        raise ValueError("no scores to resample")
    groups = [values] if strata is None else [values[[s == k for s in strata]] for k in dict.fromkeys(strata)]
    rng = np.random.default_rng(seed)
    stats = np.mean([g[rng.integers(0, len(g), size=(resamples, len(g)))].mean(axis=1) for g in groups], axis=0)
    return _bounds(stats, level)
