"""One job per run directory: rank 0 holds an exclusive `flock` on RUN_DIR/.tapetrain.lock for the job's life.

The kernel drops the lock when the process ends, however it ends (SIGKILL included), so a crashed job never
leaves a stale lock behind and a resume after SIGKILL just works. The file also names the holder (host, pid,
start time, command) so a second job can say who is in the way. The descriptor is close-on-exec, so helper
processes (the universal-checkpoint conversion) never inherit the lock. On NFS, Linux emulates flock with
POSIX locks, which NFS supports; the run directory must be on one filesystem shared by all nodes anyway.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from tapetrain.errors import RunDirLockedError

LOCK_FILE = ".tapetrain.lock"


class RunLock:
    """Exclusive lock on a run directory; `acquire()` raises RunDirLockedError naming the holder."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.created_run_dir = False
        self._fd: int | None = None

    def acquire(self) -> None:
        self.created_run_dir = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirLockedError(
                f"run directory {self.run_dir} is in use by another job ({_describe(holder)}): two jobs on one "
                "run.out_dir would interleave metrics.jsonl and overwrite each other's checkpoints. Wait for it to "
                "end, stop it (docs/run-directory.md, 'How to stop a job'), or set run.out_dir to another directory"
            ) from None
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                  "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd

    def release(self, *, failed_start: bool = False) -> None:
        """Unlock. After a failed start in a directory this job created, remove what it left (the lock file and
        the then empty directory), so a typo in run.out_dir leaves nothing behind."""
        if self._fd is None:
            return
        if failed_start and self.created_run_dir:
            self.path.unlink(missing_ok=True)
            try:
                self.run_dir.rmdir()
            except OSError:
                pass  # not empty: keep it
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('started_at', '?')}"
            f", command: {holder.get('command', '?')}")
