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


def pair_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """The per-round ratio's spread, the number of pairs and whether that many pairs make a headline."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    return {**spread(ratios), "pairs": len(ratios), "headline": len(ratios) >= MIN_HEADLINE_PAIRS}


def pairs_header(settings: Any, warmup: int, pairs: int, headline: bool) -> dict[str, Any]:
    """The fields every alternated mode's JSON carries: warm-up, pairs, whether they make a headline, versions and
    the settings that produced it."""
    from tapetrain.bench.common import software_versions

    return {"warmup_rounds": warmup, "pairs": pairs, "headline": headline, "min_headline_pairs": MIN_HEADLINE_PAIRS,
            "versions": software_versions(), "settings": asdict(settings)}  # fmt: skip
