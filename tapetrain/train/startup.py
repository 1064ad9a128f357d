"""Start-up progress: each phase of a start (config, data, model, engine, first step) is logged with its duration,
so a slow start says where it is instead of staying silent until the first logged step."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("tapetrain.train")

PHASES = ("config", "data", "model", "engine", "first step")


def since_process_start() -> float | None:
    """Seconds since this process was created (imports and launcher start-up included), when psutil can tell."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - a missing or restricted /proc only loses the total
        return None


class StartupClock:
    """Logs `start-up [i/5] PHASE: detail (N.N s)`; `begin(phase)` first announces a phase that may take long.

    The first phase counts from the process start: importing torch and DeepSpeed and joining the process group
    are part of it."""

    def __init__(self) -> None:
        self.last = time.perf_counter() - (since_process_start() or 0.0)

    def _tag(self, phase: str) -> str:
        return f"start-up [{PHASES.index(phase) + 1}/{len(PHASES)}] {phase}"

    def begin(self, phase: str, detail: str) -> None:
        log.info("%s: %s ...", self._tag(phase), detail)

    def done(self, phase: str, detail: str) -> None:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        total = ""
        if phase == PHASES[0]:
            total = " since the process started: imports, config, process group"
        if phase == PHASES[-1]:
            since_start = since_process_start()
            if since_start is not None:
                total = f"; {since_start:.1f} s from process start to the end of the first step"
        log.info("%s: %s (%.1f s%s)", self._tag(phase), detail, seconds, total)

    @contextmanager
    def phase(self, phase: str, begin: str, done: str) -> Iterator[dict]:
        """`with clock.phase("engine", "building", "ready") as note:`; `note["detail"]` replaces the done text."""
        self.begin(phase, begin)
        note: dict = {}
        yield note
        self.done(phase, note.get("detail", done))
