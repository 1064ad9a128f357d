"""A call into code that may never return (lm-eval's RULER data generators retry forever on prompts they cannot
size, printing a line per try): a wall-clock limit that ends the process with one error line, and its prints
capped so that a loop cannot fill the disk that a job's log is on.

The limit cannot be an exception: the generators catch every exception (a bare `except:`), so the watchdog thread
prints the error and ends the process (exit 1)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
from collections.abc import Iterator


class CappedWriter(io.TextIOBase):
    """Passes the first `limit` characters to `target`, then one note, then nothing."""

    def __init__(self, target, limit: int):
        self.target, self.limit, self.written = target, limit, 0

    def write(self, text: str) -> int:
        room = self.limit - self.written
        if room > 0:
            self.target.write(text[:room])
            if len(text) > room:
                self.target.write(f"\n[output cut at {self.limit} characters]\n")
        self.written += len(text)
        return len(text)

    def flush(self) -> None:
        self.target.flush()


@contextlib.contextmanager
def bounded(seconds: float, error: str, output_limit: int) -> Iterator[None]:
    """Run the block with its stdout capped at `output_limit` characters; after `seconds`, print `error` (one line,
    on stderr) and end the process with exit status 1."""

    def expire() -> None:
        sys.stdout.flush()
        print(error, file=sys.__stderr__, flush=True)
        os._exit(1)

    watchdog = threading.Timer(seconds, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        with contextlib.redirect_stdout(CappedWriter(sys.stdout, output_limit)):
            yield
    finally:
        watchdog.cancel()
