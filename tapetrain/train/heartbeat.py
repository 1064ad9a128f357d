"""Peer and launcher failures: which rank is missing when a collective fails, and a launcher that is gone.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from tapetrain import atomic_io
from tapetrain.checkpoint.store import CHECKPOINTS
from tapetrain.errors import RunError, UserError

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
# What they say when a collective waited too long: gloo "Timed out waiting 12000ms for recv operation", "Application
# timeout caused pair closure"; NCCL's watchdog "... Timeout(ms)=600000) ran for 600123 milliseconds before timing
# out", and a collective on the communicator the watchdog then aborted.
TIMEOUT_SIGNS = ("timed out", "timeout", "timing out", "communicator was aborted")


def lost_connection(err: BaseException) -> bool:
    """Whether a failed collective lost a peer's connection (a dying peer), not waited for one (a hung peer)."""
    text = str(err).lower()
    return any(sign in text for sign in LOST_CONNECTION_SIGNS)


def timed_out(err: BaseException) -> bool:
    """Whether a collective gave up waiting for a peer (a hung or dead peer), not failed for a reason of its own."""
    text = str(err).lower()
    return any(sign in text for sign in TIMEOUT_SIGNS)


def resume_hint(run_dir: Path) -> str:
    """The one way back, in every message of a job that stopped."""
    return ("start the same command again (train.resume=auto resumes from the last checkpoint in "
            f"{run_dir / CHECKPOINTS})")


@dataclass(frozen=True)
class PeerFailure:
    """Why a collective failed: "dead" (a rank's process is gone), "lost" (its connection closed; a rank on another
    node, named when its heartbeat stopped), "hung" (it did not arrive in time)."""

    kind: str
    ranks: list[RankBeat]

    def error(self, step: int, run_dir: Path, err: BaseException, timeout_minutes: float) -> RunError:
        """The job's last word: the step, the ranks, what to look at, and how to resume."""
        ranks = ", ".join(str(b.rank) for b in self.ranks)
        if self.kind == "dead":  # a peer that died closes its connections at once: not a timeout
            return RunError(
                f"step {step}: rank(s) {ranks} died ({'; '.join(b.describe_dead() for b in self.ranks)}). The job "
                "stops: find out why in that rank's log and dmesg (the OOM killer, a SIGKILL from the scheduler, a "
                f"crash), then {resume_hint(run_dir)}"
            )
        if self.kind == "lost":  # no process on this node is gone: a rank elsewhere died or lost its node
            who = (f"rank(s) {ranks} stopped beating ({'; '.join(b.describe() for b in self.ranks)})" if self.ranks
                   else "no rank's heartbeat has stopped yet")
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return RunError(
                f"step {step}: a collective lost its connection to another rank ({first_line}); {who}. A rank on "
                "another node most likely died or its node lost the network. The job stops: find out why in that "
                f"rank's log and its node's dmesg, then {resume_hint(run_dir)}"
            )
        return RunError(
            f"step {step}: rank(s) {ranks} did not arrive at a collective within "
            f"deepspeed.timeout_minutes={timeout_minutes:g} ({'; '.join(b.describe() for b in self.ranks)}). The job "
            "stops: find out why that rank hangs or died (a stopped process, a stuck device, a lost machine: its log, "
            f"dmesg), then {resume_hint(run_dir)}. Raise deepspeed.timeout_minutes if ranks legitimately wait that "
            "long (a large save)"
        )


def diagnose_peers(err: BaseException, run_dir: Path, world_size: int, rank: int, step: int,
                   wait_s: float | None = None) -> PeerFailure | None:
    """The peers behind a failed collective, from their heartbeats; None where no peer is to blame (raise err): an
    error that is neither a lost connection nor a timeout is a bug of its own, whatever the heartbeats say."""
    wait_s = DEAD_WAIT_SECONDS if wait_s is None else wait_s
    lost = lost_connection(err)
    if not lost and not timed_out(err):
        return None
    beats = read_beats(run_dir, world_size, rank)
    dead = dead_ranks(beats, wait_s if lost else 0.0)
    if dead:
        return PeerFailure("dead", dead)
    if lost:  # re-read after the wait: by now a dead rank on another node has stopped beating
        return PeerFailure("lost", missing_ranks(read_beats(run_dir, world_size, rank), step))
    missing = missing_ranks(beats, step)
    return PeerFailure("hung", missing) if missing else None


def failed_collective_error(err: BaseException, run_dir: Path, world_size: int, rank: int, step: int,
                            timeout_minutes: float) -> RunError | None:
    """The error a job that stopped on `err` at `step` raises instead, where a peer is to blame; None where `err`
    says what happened itself (a UserError, anything but a RuntimeError, no peer to blame, one rank)."""
    if world_size < 2 or isinstance(err, UserError) or not isinstance(err, RuntimeError):
        return None
    failure = diagnose_peers(err, run_dir, world_size, rank, step)
    return None if failure is None else failure.error(step, run_dir, err, timeout_minutes)


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


# ---- launchers -------------------------------------------------------------------------------------------------------

LAUNCHER_POLL_SECONDS = 1.0
DEEPSPEED_LAUNCH = "deepspeed.launcher.launch"  # DeepSpeed's per-node launch process: `python -m` this module


@dataclass(frozen=True)
class Launcher:
    """A process that supervises this rank, as recorded at start-up: its pid, the process it started (`child`: this
    rank, or the launcher below) and a description for the message."""

    pid: int
    child: int
    what: str

    def gone(self) -> bool:
        """Whether this launcher has ended: its child has another parent. A process that exits hands its children
        to init (or a subreaper) at once, before anyone reaps it, and no reused pid can take its place as their
        parent. A child that is gone itself is the launcher below's end, reported there."""
        try:
            return psutil.Process(self.child).ppid() != self.pid
        except psutil.Error:
            return False

    def gone_notice(self) -> str:
        return (f"the launcher of this rank is gone: {self.what} has ended, and nothing supervises this node's ranks "
                "any more (DeepSpeed's `deepspeed` runner ends at once on SIGTERM and leaves its ranks training; "
                "launch/single_node.sh and launch/multi_node.sh stop a job by signalling the ranks)")


def _command(process: psutil.Process) -> str:
    """A process's command line, shortened for a message."""
    try:
        words = process.cmdline()
    except psutil.Error:
        return "?"
    text = " ".join([Path(words[0]).name, *words[1:]]) if words else "?"
    return text if len(text) <= 100 else text[:97] + "..."


def _runs_module(process: psutil.Process, names: tuple[str, ...]) -> bool:
    """Whether a process runs one of `names`: a module (`python -u -m NAME`) or a script (`python .../NAME`)."""
    try:
        words = process.cmdline()
    except psutil.Error:
        return False
    return any(word in names or Path(word).name in names for word in words[:4])


def supervising_launchers() -> list[Launcher]:
    """The launchers to watch, bottom up, recorded now: call it at start-up, before one can have gone.

    A rank of DeepSpeed's launcher: its parent (the per-node launch process) and that one's parent (the `deepspeed`
    runner, or the ssh session or wrapper script that started the launch process), which the launch process outlives
    (the runner ends at once on SIGTERM). Anything else (a lone process, another launcher, a shell): nothing; other
    launchers pass signals on themselves, and a process that goes on without its parent may mean to (nohup)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return []
    try:
        parent = psutil.Process(os.getppid())
        if _runs_module(parent, (DEEPSPEED_LAUNCH,)):
            grandparent = psutil.Process(parent.ppid())
            runner = (f"the `deepspeed` runner (pid {grandparent.pid})" if _runs_module(grandparent, ("deepspeed",))
                      else f"process {grandparent.pid} (`{_command(grandparent)}`), which started DeepSpeed's launch "
                      "process of this node,")
            return [
                Launcher(parent.pid, os.getpid(), f"DeepSpeed's launch process of this node (pid {parent.pid})"),
                Launcher(grandparent.pid, parent.pid, runner),
            ]
    except psutil.Error:
        pass
    return []


class LauncherWatch:
    """Calls `on_gone(launcher)` once, from a daemon thread, when one of `launchers` has ended (checked every
    LAUNCHER_POLL_SECONDS: one /proc read per launcher)."""

    def __init__(self, launchers: list[Launcher], on_gone: Callable[[Launcher], None]):
        self.launchers = launchers
        self._on_gone = on_gone
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tapetrain-launcher-watch", daemon=True)

    def start(self) -> LauncherWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(LAUNCHER_POLL_SECONDS):
            gone = next((launcher for launcher in self.launchers if launcher.gone()), None)
            if gone is not None:
                self._on_gone(gone)
                return


def stopped_message(step: int, reason: str | None, run_dir: Path) -> str:
    """The last line of a job stopped at a step boundary (a signal, its launcher gone), its checkpoint saved."""
    return (f"stopped {reason or 'at the request of another rank'} at step {step}; checkpoint saved. To resume, "
            f"{resume_hint(run_dir)}")
