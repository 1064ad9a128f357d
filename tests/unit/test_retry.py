"""The one retry policy (tapetrain/retry.py): exponential backoff with jitter, transient errors retried, permanent
ones raised at once, the last error raised when the retries are spent."""

from __future__ import annotations

import random

import pytest

from tapetrain.retry import backoff_delays, call_with_retries


class Flaky:
    """Fails with the given errors in turn, then returns "ok"."""

    def __init__(self, *errors: Exception):
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def transient(err: BaseException) -> bool:
    return isinstance(err, ConnectionError)


def test_delays_double_with_bounded_jitter_and_differ_between_ranks():
    delays = list(backoff_delays(6, 0.5, rng=random.Random(1)))
    assert len(delays) == 6
    for k, d in enumerate(delays):
        assert 0.5 * 2**k * 0.75 <= d <= 0.5 * 2**k * 1.25
    other = list(backoff_delays(6, 0.5, rng=random.Random(2)))
    assert delays != other  # two ranks that failed together do not retry in lockstep


def test_transient_failures_are_retried_then_the_call_succeeds():
    slept, logged = [], []
    call = Flaky(ConnectionError("reset"), ConnectionError("reset"))
    out = call_with_retries(call, retries=3, base_s=0.1, transient=transient, sleep=slept.append,
                            on_retry=lambda a, d, e: logged.append(a), rng=random.Random(0))  # fmt: skip
    assert out == "ok" and call.calls == 3 and logged == [1, 2] and len(slept) == 2


def test_a_permanent_error_is_raised_at_once_and_the_last_transient_one_when_retries_are_spent():
    slept = []
    call = Flaky(PermissionError("403"))
    with pytest.raises(PermissionError):
        call_with_retries(call, retries=5, base_s=0.1, transient=transient, sleep=slept.append)
    assert call.calls == 1 and slept == []
    call = Flaky(*(ConnectionError(f"reset {i}") for i in range(10)))
    with pytest.raises(ConnectionError, match="reset 3"):
        call_with_retries(call, retries=3, base_s=0.1, transient=transient, sleep=slept.append)
    assert call.calls == 4 and len(slept) == 3
    call = Flaky(ConnectionError("reset"), FileNotFoundError("404"))
    with pytest.raises(FileNotFoundError):  # permanent during the retries: no more tries
        call_with_retries(call, retries=5, base_s=0.1, transient=transient, sleep=slept.append)
    assert call.calls == 2
