"""Comparisons that survive a shared, noisy machine: variants alternated call by call in one process, the order
rotated every round, and ratios taken per round (pair) so that a slow moment hits every variant of that round."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from tapetrain.bench.common import time_call

MIN_HEADLINE_PAIRS = 10  # fewer measured pairs give no headline ratio
# Warm-up ends when the last STEADY_WINDOW per-round ratios lie within STEADY_TOLERANCE of their median and of the
# window before: on the H200 (2026-11-26) three fixed warm-up rounds left the first 7 docmask ratios at 1.27-1.41
# against a steady 1.13 (and its first three alone, 1.36/1.33/1.29, look flat).
STEADY_WINDOW = 3
STEADY_TOLERANCE = 0.05
MAX_WARMUP_ROUNDS = 40


def rotated(items: Sequence[Any], by: int) -> list[Any]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def spread(values: Sequence[float]) -> dict[str, float]:
    """median, min–max and the interquartile range (inclusive quartiles; with < 2 values: the value)."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "q1": q1, "q3": q3}


def interleaved_times(calls: dict[str, Callable[[], Any]], device: torch.device, warmup: int,
                      rounds: int) -> dict[str, list[float]]:  # fmt: skip
    """{name: seconds per call, one per round}: `warmup` untimed rounds, then `rounds` rounds in which every call
    runs once, the order rotated by the round."""
    names = list(calls)
    for r in range(warmup):
        for name in rotated(names, r):
            calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            times[name] += time_call(calls[name], device, 0, 1)
    return times


def is_steady(ratios: Sequence[float], window: int = STEADY_WINDOW, tolerance: float = STEADY_TOLERANCE) -> bool:
    """The last `window` ratios all within `tolerance` (relative) of their median, and that median within
    `tolerance` of the median of the `window` before them (so a slow drift is not taken for a plateau)."""
    if len(ratios) < 2 * window:
        return False
    last, before = ratios[-window:], ratios[-2 * window : -window]
    mid = statistics.median(last)
    return all(abs(r / mid - 1) <= tolerance for r in last) and abs(mid / statistics.median(before) - 1) <= tolerance


def warm_until_steady(run_round: Callable[[int], tuple[float, float]], min_rounds: int,
                      max_rounds: int = MAX_WARMUP_ROUNDS) -> dict[str, Any]:
    """Warm-up rounds, each `run_round(r) -> (numerator s, denominator s)`, until at least `min_rounds` ran and the
    per-round ratio is steady (is_steady), or `max_rounds` ran. The record (for the JSON): rounds, their ratios
    (the drift) and whether the ratio settled."""
    ratios: list[float] = []
    for r in range(max(min_rounds, max_rounds)):
        num, den = run_round(r)
        ratios.append(num / den)
        if len(ratios) >= min_rounds and is_steady(ratios):
            break
    return {"rounds": len(ratios), "ratios": ratios, "steady": is_steady(ratios), "window": STEADY_WINDOW,
            "tolerance": STEADY_TOLERANCE, "max_rounds": max(min_rounds, max_rounds)}


def pair_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """The per-round ratio's spread, the number of pairs and whether that many pairs make a headline."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return {**spread(ratios), "pairs": len(ratios), "headline": len(ratios) >= MIN_HEADLINE_PAIRS}


def pairs_header(settings: Any, warmup: int, pairs: int, headline: bool) -> dict[str, Any]:
    """The fields every alternated mode's JSON carries after its header: warm-up, pairs, whether they make a
    headline and the settings that produced it."""
    return {"warmup_rounds": warmup, "pairs": pairs, "headline": headline, "min_headline_pairs": MIN_HEADLINE_PAIRS,
            "settings": asdict(settings)}  # fmt: skip
