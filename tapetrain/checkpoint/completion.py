"""Completing a checkpoint off the training thread: its manifest (every file hashed), then the rename that makes
it complete and train.keep_last's pruning.

store.save_checkpoint writes the files and passes its barriers on the training thread, then starts one thread per
rank. Each hashes its share of the files and writes it as manifest.rankNNNNN.json (manifest.rankNNNNN.failed
with the error if a file could not be read); rank 0's thread waits for every part, merges them into manifest.json,
removes the parts and calls back to rename and prune. These threads make no torch.distributed call (collectives
from two threads on one process group are unsafe): the ranks meet through files on the shared filesystem that
checkpoints already assume. The training thread joins before the next save and at the end of the run; a failure
in a thread is raised there as a CheckpointError. A process killed meanwhile leaves the .tmp directory, which is
never resumed from and is removed at the next start, like any interrupted save.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tapetrain import atomic_io
from tapetrain.checkpoint import disk, manifest
from tapetrain.errors import CheckpointError

log = logging.getLogger("tapetrain.checkpoint")

THREAD_NAME = "tapetrain-checkpoint-hash"
_POLL_S = 0.1


@dataclass(frozen=True)
class Completion:
    """What one rank's thread needs: the .tmp directory, who it is, and (rank 0) how to publish it."""

    tmp: Path
    step: int
    rank: int
    world_size: int
    timeout_s: float
    publish: Callable[[], None] | None = None  # rank 0: rename to complete, prune; other ranks: None


def part_path(checkpoint: Path, rank: int, failed: bool = False) -> Path:
    return checkpoint / f"manifest.rank{rank:05d}.{'failed' if failed else 'json'}"


class PendingCheckpoint:
    """A checkpoint whose manifest is being hashed by a background thread; join() on the training thread."""

    def __init__(self, job: Completion):
        self.job = job
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            complete(self.job)
        except BaseException as err:  # noqa: BLE001 - handed to the training thread at join(), never lost
            self.error = err

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread (True: it finished); a failure in it is raised here as a CheckpointError."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            return False
        if self.error is not None:
            raise CheckpointError(_failure_message(self.job, self.error)) from self.error
        return True


def complete(job: Completion) -> None:
    """Hash this rank's share into its part file; rank 0 then merges the parts into manifest.json and publishes."""
    started = time.perf_counter()
    names = manifest.checkpoint_files(job.tmp)  # every file was written before the barrier: the same on all ranks
    _hash_share(job, names[job.rank::job.world_size])
    if job.publish is None:
        return
    entries, hashed_by = _merge_parts(job, names)
    manifest.write_manifest(job.tmp, entries, hashed_by)
    for rank in range(job.world_size):
        part_path(job.tmp, rank).unlink()
    size = sum(e["bytes"] for e in entries.values())
    log.info("checksummed %d files (%s) in %.2f s off the training thread", len(entries), disk.human(size),
             time.perf_counter() - started)
    job.publish()


def _hash_share(job: Completion, names: list[str]) -> None:
    """This rank's part file; on failure a .failed part, so that rank 0 stops at once instead of at its timeout."""
    try:
        entries = manifest.describe_strict(job.tmp, names)
        payload = {"rank": job.rank, "thread": threading.current_thread().name, "files": entries}
        atomic_io.write_json(part_path(job.tmp, job.rank), payload, indent=1, newline=False)
    except OSError as err:
        message = f"rank {job.rank} could not hash {job.tmp.name}/{_name_of(err, job.tmp)}: {err}"
        with contextlib.suppress(OSError):  # a full disk may refuse this too: rank 0 then stops at its timeout
            atomic_io.write_json(part_path(job.tmp, job.rank, failed=True), {"error": message}, indent=1,
                                 newline=False)
        raise CheckpointError(message) from err


def _name_of(err: OSError, checkpoint: Path) -> str:
    try:
        return str(Path(err.filename).relative_to(checkpoint))
    except (TypeError, ValueError):
        return "a file"


def _merge_parts(job: Completion, names: list[str]) -> tuple[dict[str, dict], dict[str, str]]:
    """Every rank's part (waiting for them up to job.timeout_s); a failed part or a file left out raises."""
    entries: dict[str, dict] = {}
    hashed_by: dict[str, str] = {}
    for rank in range(job.world_size):
        part = _wait_for_part(job, rank)
        entries.update(part["files"])
        hashed_by[str(rank)] = part["thread"]
    left_out = sorted(set(names) - set(entries))
    if left_out:
        raise CheckpointError(f"no rank hashed {', '.join(left_out)}")
    return entries, hashed_by


def _wait_for_part(job: Completion, rank: int) -> dict:
    deadline = time.monotonic() + job.timeout_s
    ok, failed = part_path(job.tmp, rank), part_path(job.tmp, rank, failed=True)
    while time.monotonic() < deadline:
        if failed.is_file():
            raise CheckpointError(json.loads(failed.read_text())["error"])
        if ok.is_file():
            return json.loads(ok.read_text())
        time.sleep(_POLL_S)
    raise CheckpointError(f"rank {rank} did not hash its share of {job.tmp.name} within {job.timeout_s:.0f} s "
                          f"(no {ok.name} appeared; the rank may have stopped)")


def _failure_message(job: Completion, err: BaseException) -> str:
    detail = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
    return (f"the checkpoint of step {job.step} could not be completed: {detail}. It stays {job.tmp}, an "
            "incomplete checkpoint that is never resumed from (the next start deletes it and resumes from the newest "
            "complete checkpoint). Check the disk of the run directory (free space, files removed by another "
            "process), then start the same command again")
