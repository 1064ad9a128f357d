"""Progress bars that suit where the output goes: tqdm on a terminal; in a redirected log (`make demo > demo.log`,
a batch job's output file) one plain line every `interval` seconds and a closing line, since tqdm's carriage-return
redraws would turn the log into one huge line. Every progress bar of the package is made here."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

from tqdm import tqdm

PLAIN_INTERVAL_S = 30.0


def progress(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "", unit: str = "it",
             unit_scale: bool = False, disable: bool | None = False, leave: bool = True, stream: IO | None = None,
             interval: float = PLAIN_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
    """A tqdm bar when `stream` (default stderr) is a terminal, else a PlainProgress; both offer iteration,
    update(n), set_postfix_str(text), n, total, close() and `with`. `disable`: no output at all."""
    stream = stream or sys.stderr
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if disable or not stream.isatty():
        return PlainProgress(iterable, total, desc, unit, unit_scale, stream, interval, clock, silent=bool(disable))
    return tqdm(iterable, total=total, desc=desc, unit=unit, unit_scale=unit_scale, leave=leave, file=stream,
                dynamic_ncols=True, mininterval=0.5)


def _number(value: float, scale: bool) -> str:
    if scale:
        return tqdm.format_sizeof(value)  # 1.23M
    return f"{value:,.0f}" if value >= 100 or value == int(value) else f"{value:.3g}"


def _amount(value: float, unit: str, scale: bool) -> str:
    return f"{_number(value, scale)}{'' if unit == 'B' else ' '}{unit}"  # 1.2MB, 1.2M tok, 150 doc


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class PlainProgress:
    """`desc: n/total unit (pct), rate, ETA, postfix` every `interval` seconds, and `desc: done, ...` at close."""

    def __init__(self, iterable: Iterable | None, total: float | None, desc: str, unit: str, unit_scale: bool,
                 stream: IO, interval: float, clock: Callable[[], float], silent: bool = False):
        self.iterable, self.total, self.desc, self.unit, self.scale = iterable, total, desc, unit, unit_scale
        self.stream, self.interval, self.clock, self.silent = stream, interval, clock, silent
        self.n: float = 0
        self.postfix = ""
        self.start = self.last_line = clock()
        self.closed = False

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None, "progress(): nothing to iterate over"
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self.postfix = text

    def update(self, n: float = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.last_line >= self.interval:
            self.last_line = now
            self._write(self._status(now - self.start))

    def _status(self, elapsed: float) -> str:
        rate = self.n / elapsed if elapsed > 0 else 0.0
        done = _amount(self.n, self.unit, self.scale)
        done_total = _amount(self.total or 0, self.unit, self.scale)
        parts = [f"{_number(self.n, self.scale)}/{done_total} ({self.n / self.total:.0%})" if self.total
                 else done, f"{_amount(rate, self.unit, self.scale)}/s"]
        if self.total and rate > 0:
            parts.append(f"ETA {format_duration((self.total - self.n) / rate)}")
        if self.postfix:
            parts.append(self.postfix)
        return ", ".join(parts)

    def _write(self, status: str) -> None:
        if not self.silent:
            print(f"{self.desc}: {status}" if self.desc else status, file=self.stream, flush=True)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        elapsed = self.clock() - self.start
        rate = f" ({_amount(self.n / elapsed, self.unit, self.scale)}/s)" if elapsed > 0 else ""
        self._write(f"done, {_amount(self.n, self.unit, self.scale)} in {format_duration(elapsed)}{rate}")
