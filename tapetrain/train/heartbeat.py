"""Which rank is missing when a collective times out: every rank's heartbeat file under the run directory.

A rank that hangs (SIGSTOP, a stuck kernel, a dead machine) leaves the others blocked in their next collective
until deepspeed.timeout_minutes; the error torch then raises says only that a receive timed out. So a tiny daemon
thread on every rank rewrites RUN_DIR/heartbeats/rankN.json every HEARTBEAT_SECONDS with the step it is on; the
rank whose collective timed out reads the others' files and names the ranks whose heartbeat stopped or that are
behind its step. A stopped process stops its thread too; a rank stuck in a kernel keeps beating at an old step. A
rank whose process is gone (killed, crashed) is named as dead, not as late: its peers see its connection close.
Heartbeat times are wall-clock seconds: across machines they assume synchronised clocks (NTP), as logs do.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tapetrain import atomic_io

HEARTBEAT_DIR = "heartbeats"
HEARTBEAT_SECONDS = 2.0
STALE_SECONDS = 3 * HEARTBEAT_SECONDS + 1  # a beat or two may be late on a busy machine; three are not
# SIGKILL closes a process's sockets before it leaves the process table: a peer's "connection reset" can arrive
# while the killed rank still looks alive. Waiting this long for it to go costs a hung job only seconds.
DEAD_WAIT_SECONDS = 10.0


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return run_dir / HEARTBEAT_DIR / f"rank{rank}.json"


class Heartbeat:
    """Writes this rank's heartbeat file from a daemon thread until stop(); `step` is the step being worked on.
    Setting `step` wakes the thread, so the file names the step a rank was on when it died, not one from up to
    HEARTBEAT_SECONDS earlier (the write stays off the training thread)."""

    def __init__(self, run_dir: Path, rank: int, step: int):
        self.path = heartbeat_path(run_dir, rank)
        self.rank = rank
        self._step = step
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"tapetrain-heartbeat-{rank}", daemon=True)

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        self._wake.set()

    def start(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()  # before the first collective of the loop
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()

    def _beat(self) -> None:
        while True:
            self._wake.wait(HEARTBEAT_SECONDS)
            self._wake.clear()
            if self._stopped.is_set():
                return
            try:
                self._write()
            except OSError:  # a full or vanished disk: the save path reports it; never kill the rank from here
                pass

    def _write(self) -> None:
        record = {
            "rank": self.rank,
            "step": self._step,
            "time": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        atomic_io.write_json(self.path, record, indent=None, newline=False)  # a reader never sees half a file


@dataclass(frozen=True)
class RankBeat:
    """Another rank's last heartbeat as seen now (age in seconds; None where it never wrote one)."""

    rank: int
    step: int | None = None
    age_s: float | None = None
    host: str = "?"
    pid: int | None = None

    def describe(self) -> str:
        if self.age_s is None:
            return f"rank {self.rank}: no heartbeat"
        return (
            f"rank {self.rank}: last heartbeat {self.age_s:.0f} s ago, working on step {self.step}, host {self.host} "
            f"pid {self.pid}"
        )

    def describe_dead(self) -> str:
        return (f"rank {self.rank}: process {self.pid} on {self.host} is gone, its connection closed; last "
                f"heartbeat {self.age_s:.0f} s ago, working on step {self.step}")

    def process_gone(self) -> bool:
        """Whether this rank's process has ended (only known for a process on this host)."""
        if self.pid is None or self.host != socket.gethostname():
            return False
        try:
            import psutil

            return psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False


def read_beats(run_dir: Path, world_size: int, skip_rank: int) -> list[RankBeat]:
    """Every other rank's last heartbeat."""
    now = time.time()
    beats = []
    for rank in range(world_size):
        if rank == skip_rank:
            continue
        try:
            record = json.loads(heartbeat_path(run_dir, rank).read_text())
        except (OSError, ValueError):
            beats.append(RankBeat(rank))
            continue
        beats.append(
            RankBeat(
                rank,
                int(record["step"]),
                max(0.0, now - float(record["time"])),
                record.get("host", "?"),
                record.get("pid"),
            )
        )
    return beats


# What torch's backends say when a peer's connection closes (gloo; NCCL), as opposed to a timeout or a bug.
LOST_CONNECTION_SIGNS = ("connection reset", "connection closed", "broken pipe", "remote process exited",
                         "network error", "connection refused", "end of file")


def lost_connection(err: BaseException) -> bool:
    """Whether a failed collective lost a peer's connection (a dying peer), not waited for one (a hung peer)."""
    text = str(err).lower()
    return any(sign in text for sign in LOST_CONNECTION_SIGNS)


@dataclass(frozen=True)
class PeerFailure:
    """Why a collective failed: "dead" (a rank's process is gone), "lost" (its connection closed; a rank on another
    node, named when its heartbeat stopped), "hung" (it did not arrive in time)."""

    kind: str
    ranks: list[RankBeat]


def diagnose_peers(err: BaseException, run_dir: Path, world_size: int, rank: int, step: int,
                   wait_s: float | None = None) -> PeerFailure | None:
    """The peers behind a failed collective, from their heartbeats; None where no peer is to blame (raise err)."""
    wait_s = DEAD_WAIT_SECONDS if wait_s is None else wait_s
    lost = lost_connection(err)
    beats = read_beats(run_dir, world_size, rank)
    dead = dead_ranks(beats, wait_s if lost else 0.0)
    if dead:
        return PeerFailure("dead", dead)
    if lost:  # re-read after the wait: by now a dead rank on another node has stopped beating
        return PeerFailure("lost", missing_ranks(read_beats(run_dir, world_size, rank), step))
    missing = missing_ranks(beats, step)
    return PeerFailure("hung", missing) if missing else None


def dead_ranks(beats: list[RankBeat], wait_s: float = DEAD_WAIT_SECONDS) -> list[RankBeat]:
    """The ranks whose process is gone, waiting up to wait_s for one that is still exiting (none found: [])."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [b for b in beats if b.process_gone()]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.1)


def missing_ranks(beats: list[RankBeat], step: int) -> list[RankBeat]:
    """The ranks that cannot have reached this step's collective: heartbeat stopped (or never written), or behind."""
    return [b for b in beats if b.age_s is None or b.age_s > STALE_SECONDS or (b.step is not None and b.step < step)]
