"""Paired bootstrap intervals (tapetrain.eval.bootstrap) on synthetic per-window NLLs and per-trial scores."""

from __future__ import annotations

import numpy as np
import pytest

from tapetrain.eval.bootstrap import mean_interval, paired_mean_interval, paired_ppl_interval, ppl_interval


def windows(seed: int = 0, n: int = 200) -> tuple[np.ndarray, list[int]]:
    """Per-window NLL sums whose difficulty varies a lot from window to window (as real text does)."""
    rng = np.random.default_rng(seed)
    tokens = [127] * n
    difficulty = rng.gamma(4.0, 0.6, size=n)  # per-token nats, window to window
    return difficulty * 127, tokens


def test_identical_models_give_exactly_zero():
    nll, tokens = windows()
    assert paired_ppl_interval(nll, tokens, nll, tokens) == (0.0, 0.0)
    scores = [1.0, 0.0, 1.0, 1.0, 0.0]
    assert paired_mean_interval(scores, scores) == (0.0, 0.0)


def test_a_constant_shift_is_resolved_in_its_direction():
    nll, tokens = windows()
    low, high = paired_ppl_interval(nll, tokens, nll + 0.02 * 127, tokens)  # 0.02 nats/token worse everywhere
    assert 0 < low <= high
    low, high = paired_ppl_interval(nll, tokens, nll - 0.02 * 127, tokens)
    assert low <= high < 0
    ref = np.zeros(50)
    low, high = paired_mean_interval(ref, ref + np.r_[np.ones(10), np.zeros(40)])  # 10 more hits of 50
    assert 0 < low <= high


def test_paired_interval_is_narrower_than_the_unpaired_difference():
    """Two models that agree on which windows are hard: the paired interval of PPL(b) − PPL(a) must be much narrower
    than the interval the two unpaired intervals imply (and than either alone), and still contain the point value."""
    nll, tokens = windows()
    noise = np.random.default_rng(1).normal(0.0, 0.01, size=len(nll)) * 127
    other = nll + 0.005 * 127 + noise
    low, high = paired_ppl_interval(nll, tokens, other, tokens)
    point = np.exp(other.sum() / sum(tokens)) - np.exp(nll.sum() / sum(tokens))
    assert low <= point <= high
    a_low, a_high = ppl_interval(nll, tokens)
    b_low, b_high = ppl_interval(other, tokens, seed=1)
    assert high - low < 0.2 * min(a_high - a_low, b_high - b_low)
    assert low > 0  # resolved, although the two unpaired intervals overlap
    assert b_low < a_high


def test_paired_resampling_uses_the_single_model_draws():
    """Paired resampling draws the same window indices as the single-model interval with the same seed."""
    nll, tokens = windows()
    zeros = np.zeros_like(nll)
    low, high = paired_ppl_interval(zeros, tokens, nll, tokens, seed=3)
    single = ppl_interval(nll, tokens, seed=3)
    assert (low + 1, high + 1) == pytest.approx(single)  # exp(0) = 1 for the all-zero reference
    strata = ["a"] * 3 + ["b"] * 2
    scores = [1.0, 0.0, 1.0, 0.5, 0.0]
    assert paired_mean_interval([0.0] * 5, scores, strata=strata, seed=2) == \
        pytest.approx(mean_interval(scores, seed=2, strata=strata))


def test_mismatched_lengths_are_refused():
    nll, tokens = windows(n=10)
    with pytest.raises(ValueError):
        paired_ppl_interval(nll, tokens, nll[:9], tokens[:9])
    with pytest.raises(ValueError):
        paired_mean_interval([1.0, 0.0], [1.0])
