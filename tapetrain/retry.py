"""One retry policy for calls that fail transiently (object storage, HTTP): exponential backoff with jitter.

Jitter matters on clusters: ranks that lost one connection together would otherwise retry in lockstep and hit the
server together again. Whether an error is transient is the caller's knowledge (a predicate); a permanent error is
raised at once, and the last transient one is raised once the retries are spent.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
JITTER = 0.25  # each delay scaled by a factor in [1 − JITTER, 1 + JITTER]


def backoff_delays(retries: int, base_s: float, jitter: float = JITTER,
                   rng: random.Random | None = None) -> Iterator[float]:
    """`retries` delays: base_s · 2^k (k = 0, 1, ...), each with its random jitter."""
    rng = rng or random.Random()
    for attempt in range(retries):
        yield base_s * 2**attempt * rng.uniform(1 - jitter, 1 + jitter)


def retry_after(first: BaseException, call: Callable[[], T], *, retries: int, base_s: float,
                transient: Callable[[BaseException], bool],
                on_retry: Callable[[int, float, BaseException], None] | None = None,
                sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None) -> T:
    """After `call` failed transiently with `first`: up to `retries` more calls, each after its backoff delay;
    `on_retry(attempt, delay, error)` before each (for the log). Raises a permanent error at once, else the last."""
    err = first
    for attempt, delay in enumerate(backoff_delays(retries, base_s, rng=rng), start=1):
        if on_retry is not None:
            on_retry(attempt, delay, err)
        sleep(delay)
        try:
            return call()
        except Exception as again:  # noqa: BLE001 - the predicate decides what is worth another try
            err = again
            if not transient(err):
                raise
    raise err


def call_with_retries(call: Callable[[], T], *, retries: int, base_s: float,
                      transient: Callable[[BaseException], bool],
                      on_retry: Callable[[int, float, BaseException], None] | None = None,
                      sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None) -> T:
    """`call()`, retried as `retry_after` when it fails transiently."""
    try:
        return call()
    except Exception as err:  # noqa: BLE001
        if not transient(err) or retries <= 0:
            raise
        return retry_after(err, call, retries=retries, base_s=base_s, transient=transient, on_retry=on_retry,
                           sleep=sleep, rng=rng)
