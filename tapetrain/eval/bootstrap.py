"""Seeded percentile-bootstrap confidence intervals of the eval results (numpy only).

Perplexity resamples windows: each resample draws as many windows as were scored, with replacement, and takes
exp(Σ NLL / Σ tokens) of the draw (the token-weighted PPL of the protocol). Accuracies resample trials: the mean
of a draw of as many 0/1 (or fractional) scores as there were; with strata (RULER's tasks) each stratum is
resampled on its own and the strata's means averaged, as the point estimate is. The interval is the
(α/2, 1 − α/2) percentiles of the resampled statistics; one seed makes every interval repeatable.

Paired intervals compare two models scored on the same windows (or trials): each resample draws one set of indices
and applies it to both, so the window-to-window variation both models share cancels. For perplexity the statistic
is PPL(model) − PPL(reference), each the token-weighted PPL of the same draw (in the table's units; its sign says
which is lower); for accuracies the mean of the per-trial differences (per stratum, strata averaged), which is the
difference of the means. With the same seed the draws are exactly those of the single-model intervals.
"""

from __future__ import annotations

import numpy as np

DEFAULT_RESAMPLES = 1000
DEFAULT_LEVEL = 0.95
CHUNK_DRAWS = 1 << 22


def _bounds(samples: np.ndarray, level: float) -> tuple[float, float]:
    low, high = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def _ppl_arrays(window_nll, window_tokens) -> tuple[np.ndarray, np.ndarray]:
    nll, tokens = np.asarray(window_nll, dtype=np.float64), np.asarray(window_tokens, dtype=np.float64)
    if len(nll) != len(tokens) or not len(nll):
        raise ValueError(f"{len(nll)} window NLLs for {len(tokens)} token counts")
    return nll, tokens


def _resampled_ppl(models: list[tuple[np.ndarray, np.ndarray]], resamples: int, seed: int) -> np.ndarray:
    """(models, resamples) token-weighted PPLs, every model on the same resampled windows."""
    windows = len(models[0][0])
    rng = np.random.default_rng(seed)
    chunk = max(1, CHUNK_DRAWS // windows)  # resamples per block: (chunk, windows) indices stay ~32 MB
    stats = []
    for first in range(0, resamples, chunk):
        draws = rng.integers(0, windows, size=(min(chunk, resamples - first), windows))  # (chunk, windows)
        stats.append([np.exp(nll[draws].sum(axis=1) / tokens[draws].sum(axis=1)) for nll, tokens in models])
    return np.concatenate(stats, axis=1)


def ppl_interval(window_nll: list[float], window_tokens: list[int], resamples: int = DEFAULT_RESAMPLES,
                 seed: int = 0, level: float = DEFAULT_LEVEL) -> tuple[float, float]:
    """CI of exp(Σ nll / Σ tokens) over windows resampled with replacement."""
    return _bounds(_resampled_ppl([_ppl_arrays(window_nll, window_tokens)], resamples, seed)[0], level)


def paired_ppl_interval(ref_nll: list[float], ref_tokens: list[int], window_nll: list[float],
                        window_tokens: list[int], resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                        level: float = DEFAULT_LEVEL) -> tuple[float, float]:
    """CI of PPL(model) − PPL(reference) over the same windows, resampled together (the same draw for both)."""
    ref, model = _ppl_arrays(ref_nll, ref_tokens), _ppl_arrays(window_nll, window_tokens)
    if len(ref[0]) != len(model[0]):
        raise ValueError(f"{len(model[0])} windows against the reference's {len(ref[0])}: not the same windows")
    stats = _resampled_ppl([ref, model], resamples, seed)
    return _bounds(stats[1] - stats[0], level)


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


def paired_mean_interval(ref_scores: list[float], scores: list[float], resamples: int = DEFAULT_RESAMPLES,
                         seed: int = 0, level: float = DEFAULT_LEVEL,
                         strata: list[str] | None = None) -> tuple[float, float]:
    """CI of mean(scores) − mean(ref_scores) over the same trials, resampled together: the mean_interval of the
    per-trial differences (a mean is linear, so that is the difference of the resampled means)."""
    if len(ref_scores) != len(scores):
        raise ValueError(f"{len(scores)} scores against the reference's {len(ref_scores)}: not the same trials")
    diff = np.asarray(scores, dtype=np.float64) - np.asarray(ref_scores, dtype=np.float64)
    return mean_interval(list(diff), resamples, seed, level, strata)
