"""Heartbeat files: which ranks a rank whose collective timed out reports as missing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from tapetrain.train.heartbeat import (
    HEARTBEAT_SECONDS,
    STALE_SECONDS,
    Heartbeat,
    RankBeat,
    dead_ranks,
    heartbeat_path,
    missing_ranks,
    read_beats,
)


def write_beat(run_dir, rank: int, step: int, age_s: float) -> None:
    path = heartbeat_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "step": step, "time": time.time() - age_s, "host": "h", "pid": 7}))


def test_stale_behind_and_absent_ranks_are_missing(tmp_path):
    write_beat(tmp_path, 1, 5, age_s=1)  # fresh, same step: arrived (or on its way)
    write_beat(tmp_path, 2, 5, age_s=STALE_SECONDS + 5)  # stopped
    write_beat(tmp_path, 3, 4, age_s=1)  # alive but stuck in an earlier step
    beats = read_beats(tmp_path, world_size=5, skip_rank=0)  # rank 4 never wrote one
    assert [b.rank for b in missing_ranks(beats, step=5)] == [2, 3, 4]
    described = {b.rank: b.describe() for b in beats}
    assert described[2].startswith("rank 2: last heartbeat 1") and "working on step 5, host h pid 7" in described[2]
    assert described[4] == "rank 4: no heartbeat"


def test_the_thread_writes_the_current_step(tmp_path):
    """At once (issue #40: a rank killed mid-run was reported at a step from up to HEARTBEAT_SECONDS before)."""
    beat = Heartbeat(tmp_path, 0, 1).start()
    try:
        beat.step = 3
        deadline = time.time() + HEARTBEAT_SECONDS / 4
        while json.loads(heartbeat_path(tmp_path, 0).read_text())["step"] != 3:
            assert time.time() < deadline
            time.sleep(0.1)
    finally:
        beat.stop()


def test_a_peer_still_exiting_is_named_dead(tmp_path):
    """CI 2026-11-27: SIGKILL closes a rank's sockets before its process is gone from the process table, so the
    survivor's "Connection reset by peer" could arrive while the dead rank still looked alive; the job then ended
    as an internal error instead of naming the dead rank. The check now waits a little for the process to go."""
    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = socket.gethostname()
        beats = [RankBeat(1, 5, 0.5, host, exiting.pid), RankBeat(2, 5, 0.5, host, alive.pid)]
        assert not beats[0].process_gone()  # still sleeping: the race this test is about
        started = time.monotonic()
        assert [b.rank for b in dead_ranks(beats, wait_s=20)] == [1]
        assert time.monotonic() - started < 15
        assert dead_ranks(beats[1:], wait_s=0.5) == []  # a live peer is not dead, and the wait is bounded
    finally:
        alive.kill()
        alive.wait()
        exiting.wait()
