"""Heartbeat files: which ranks a rank whose collective timed out reports as missing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil

from tapetrain.errors import RunError
from tapetrain.train.heartbeat import (
    HEARTBEAT_SECONDS,
    STALE_SECONDS,
    Heartbeat,
    Launcher,
    RankBeat,
    dead_ranks,
    diagnose_peers,
    failed_collective_error,
    heartbeat_path,
    lost_connection,
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


GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:33981: Connection reset by peer. This is typically caused by a remote worker hanging or "
              "bugs in the application.")  # what CI's survivor got on 2026-11-27
GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 12000ms for recv "
                "operation")


def test_a_lost_connection_is_told_from_a_timeout_and_from_a_bug():
    """Only a lost connection waits for a dying peer; a timeout is a hung rank and any other RuntimeError (a bug in
    the step) is raised as it is, without a wait."""
    assert lost_connection(RuntimeError(GLOO_RESET))
    assert lost_connection(RuntimeError("NCCL error: remote process exited or there was a network error"))
    assert not lost_connection(RuntimeError(GLOO_TIMEOUT))
    assert not lost_connection(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 6x8)"))


def test_a_peer_on_another_node_that_stopped_beating_is_named_as_lost(tmp_path):
    """A dead rank on another node cannot be looked up in the process table: after the wait its heartbeat has
    stopped, and it is the rank named (it used to end the job as "an internal error, a bug in tapetrain")."""
    write_beat(tmp_path, 1, 5, age_s=STALE_SECONDS + 1)  # host "h": not this machine
    write_beat(tmp_path, 2, 5, age_s=0.5)
    started = time.monotonic()
    failure = diagnose_peers(RuntimeError(GLOO_RESET), tmp_path, world_size=3, rank=0, step=5, wait_s=0.5)
    assert failure.kind == "lost" and [b.rank for b in failure.ranks] == [1]
    assert time.monotonic() - started >= 0.5  # it waited for a process that might still be going
    hung = diagnose_peers(RuntimeError(GLOO_TIMEOUT), tmp_path, world_size=3, rank=0, step=5, wait_s=30)
    assert hung.kind == "hung" and [b.rank for b in hung.ranks] == [1]  # no wait on a timeout
    write_beat(tmp_path, 1, 5, age_s=0.5)  # every peer beating: a bug in the step is no peer's failure
    assert diagnose_peers(RuntimeError("shapes cannot be multiplied"), tmp_path, 3, 0, step=5, wait_s=30) is None


def test_a_bug_is_raised_as_itself_even_when_a_peer_looks_late(tmp_path):
    """Issue #46: a RuntimeError that is neither a lost connection nor a timeout (a bug in the step) was reported as
    a hang whenever some peer's heartbeat was stale or behind, e.g. on a busy machine."""
    write_beat(tmp_path, 1, 5, age_s=STALE_SECONDS + 5)  # stopped beating
    write_beat(tmp_path, 2, 4, age_s=0.5)  # behind
    bug = RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 6x8)")
    started = time.monotonic()
    assert diagnose_peers(bug, tmp_path, world_size=3, rank=0, step=5, wait_s=30) is None
    assert time.monotonic() - started < 5  # no wait for a dying peer either
    hung = diagnose_peers(RuntimeError(GLOO_TIMEOUT), tmp_path, world_size=3, rank=0, step=5, wait_s=30)
    assert hung.kind == "hung" and [b.rank for b in hung.ranks] == [1, 2]  # the same beats after a timeout


def test_a_failed_collective_becomes_one_message_with_the_resume_hint(tmp_path):
    write_beat(tmp_path, 1, 5, age_s=STALE_SECONDS + 5)
    hung = failed_collective_error(RuntimeError(GLOO_TIMEOUT), tmp_path, 2, 0, step=5, timeout_minutes=0.2)
    assert isinstance(hung, RunError) and str(hung).startswith("step 5: rank(s) 1 did not arrive at a collective "
                                                               "within deepspeed.timeout_minutes=0.2 (rank 1: last")
    assert f"start the same command again (train.resume=auto resumes from the last checkpoint in {tmp_path}" in (
        str(hung))
    for said_it_all in (RunError("disk full"), ValueError("bad value"), RuntimeError("shapes cannot be multiplied")):
        assert failed_collective_error(said_it_all, tmp_path, 2, 0, step=5, timeout_minutes=0.2) is None
    assert failed_collective_error(RuntimeError(GLOO_TIMEOUT), tmp_path, 1, 0, step=5, timeout_minutes=0.2) is None


def test_a_launcher_that_ended_is_gone_before_it_is_reaped():
    """A launcher's end shows as its child's new parent: at once, while the launcher is an unreaped zombie."""
    spawn = "import subprocess, sys, time; print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']).pid, flush=True); time.sleep(60)"  # noqa: E501
    launcher = subprocess.Popen([sys.executable, "-c", spawn], stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    try:
        watched = Launcher(launcher.pid, child, "the test's launcher")
        assert not watched.gone()
        launcher.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not watched.gone():
            assert time.monotonic() < deadline, "the launcher's end was not seen"
            time.sleep(0.05)
        while psutil.Process(launcher.pid).status() != psutil.STATUS_ZOMBIE:  # ended, and nobody has reaped it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "the launcher of this rank is gone: the test's launcher has ended" in watched.gone_notice()
    finally:
        os.kill(child, signal.SIGKILL)
        launcher.kill()
        launcher.wait()
