"""A bounded, node-local cache of remote shards, shared by every rank (and run) on the node through file locks.

Layout under the cache root: one directory per dataset URL (`<sha256(url)[:16]>/`, with `source.txt` naming it),
holding finished shards under their manifest names and, while downloading, `.NAME.part`; `.verified/NAME` holds
the sha256 a shard was checked against when it was downloaded. A cached shard is used only when its size and that
sha256 equal the current manifest's: a dataset replaced at the same URL is fetched again. Three kinds of lock,
all fcntl.flock (released by the kernel when a process dies, so a SIGKILL leaves no stale lock):

  .cache.lock            exclusive, briefly: the size accounting and eviction of the whole cache
  .locks/NAME.lock       exclusive while one process downloads NAME: one download per shard per node
  .locks/NAME.pin        shared while a reader has NAME open (mapped); eviction takes it exclusive without
                         blocking, so a shard in use is never evicted

A download first reserves its full size (posix_fallocate of the .part file, so a full disk fails at once with a
clear error), evicting least recently used unpinned shards until the cache fits data.cache_limit_gb; it is checked
against the manifest's sha256 while written and renamed into place only when it matches.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field

from tapetrain import atomic_io
from tapetrain.data import remote
from tapetrain.data.errors import DataError
from tapetrain.data.format import file_sha256

log = logging.getLogger("tapetrain.data")

WAIT_FOR_ROOM_S = 120.0  # how long a read waits for pinned shards to be released before giving up


def default_cache_dir() -> str:
    """Node-local and shared by the runs of one user: $TMPDIR/tapetrain-cache-UID (data.cache_dir: null)."""
    return os.path.join(tempfile.gettempdir(), f"tapetrain-cache-{os.getuid()}")


@dataclass
class CacheStats:
    """Process-wide counters, logged with every step's metrics while remote data is read."""

    bytes_fetched: int = 0
    hits: int = 0  # shard opened from the cache (also: downloaded by another rank of the node)
    misses: int = 0  # shard downloaded by this process
    active: bool = False  # set when a remote dataset is opened
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, bytes_fetched: int = 0, hits: int = 0, misses: int = 0) -> None:
        with self._lock:
            self.bytes_fetched += bytes_fetched
            self.hits += hits
            self.misses += misses

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "data_fetched_bytes": self.bytes_fetched,
                "data_cache_hits": self.hits,
                "data_cache_misses": self.misses,
            }


STATS = CacheStats()


def remote_data_metrics() -> dict[str, int]:
    """This process's cumulative fetch counters for the step metrics; empty while no remote data was opened."""
    return STATS.snapshot() if STATS.active else {}


def _open_lock(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


class _Flock:
    """An flock held on a lock file (context manager); `try_exclusive` does not block."""

    def __init__(self, path: str, mode: int = fcntl.LOCK_EX):
        self.fd = _open_lock(path)
        try:
            fcntl.flock(self.fd, mode)
        except BaseException:
            os.close(self.fd)
            raise

    @staticmethod
    def try_exclusive(path: str) -> _Flock | None:
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        lock = _Flock.__new__(_Flock)
        lock.fd = fd
        return lock

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = -1

    def __enter__(self) -> _Flock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Pin:
    """A shard present in the cache and protected from eviction until release()."""

    def __init__(self, path: str, lock: _Flock):
        self.path, self._lock = path, lock

    def release(self) -> None:
        if self._lock.fd >= 0:
            try:
                os.utime(self.path)  # recently used: evicted last
            except OSError:
                pass
            self._lock.release()


class CacheFull(Exception):
    """No room without evicting shards in use (internal: prefetch skips, a read waits then raises DataError)."""


def _disk_full(root: str, need: str) -> DataError:
    return DataError(
        f"the cache disk is full: no room for {need} in {root}; free space there, lower data.cache_limit_gb below "
        "the free space, or point data.cache_dir at a larger node-local disk"
    )


_STALE_REPORTED: set[str] = set()  # dataset URLs whose changed shards this process has reported
_STALE_LOCK = threading.Lock()


def _verified(d: str, name: str) -> str:
    return os.path.join(d, ".verified", name)


def _current(d: str, name: str, size: int, sha256: str, url: str | None = None) -> bool:
    """Whether the cached shard `name` is the manifest's: present, of its size, checked against its sha256. A
    cached shard without a record (a cache written before records existed) is hashed once. With `url` (the
    download lock held), a present shard that is not current is reported before it is fetched again."""
    path = os.path.join(d, name)
    try:
        on_disk = os.path.getsize(path)
    except FileNotFoundError:
        return False
    try:
        with open(_verified(d, name), encoding="ascii") as f:
            recorded = f.read().strip()
    except FileNotFoundError:
        recorded = file_sha256(path) if on_disk == size else ""
        if recorded == sha256:
            _record(d, name, sha256)
    if on_disk == size and recorded == sha256:
        return True
    with _STALE_LOCK:  # one line per dataset, not one per shard (a prefetch thread may find one too)
        first = url is not None and url not in _STALE_REPORTED
        _STALE_REPORTED.add(url or "")
    if first:
        log.warning(
            "cached shard %s of %s does not match the manifest (size %d, sha256 %s; the manifest lists %d, %s): "
            "the dataset at that URL changed; its cached shards that differ are fetched again",
            name,
            url,
            on_disk,
            recorded[:12] or "unknown",
            size,
            sha256[:12],
        )
    return False


def _record(d: str, name: str, sha256: str) -> None:
    """Write the sha256 that shard `name` was checked against (atomically: a reader sees the old or the new)."""
    os.makedirs(os.path.join(d, ".verified"), exist_ok=True)
    atomic_io.write_text(_verified(d, name), sha256 + "\n")  # unique temp names: a prefetch thread may race a reader


def _forget(d: str, name: str) -> None:
    """Remove shard `name` and its record (record first: a shard without one is hashed, never trusted)."""
    for path in (_verified(d, name), os.path.join(d, name)):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


class ShardCache:
    """Remote shards of any number of datasets in one directory, at most `limit_bytes` in total."""

    def __init__(self, root: str | None, limit_gb: float | None):
        self.root = os.path.abspath(os.path.expanduser(root or default_cache_dir()))
        if limit_gb is not None and not limit_gb > 0:
            raise DataError(f"data.cache_limit_gb must be > 0 (or null for no limit), got {limit_gb}")
        self.limit = int(limit_gb * 1e9) if limit_gb is not None else None  # the directory is made on first use

    def source_dir(self, url: str) -> str:
        d = os.path.join(self.root, hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16])
        try:
            os.makedirs(os.path.join(d, ".locks"), exist_ok=True)
        except OSError as err:
            raise DataError(
                f"data.cache_dir {self.root} cannot be created ({err}); point it at a writable node-local directory"
            ) from err
        note = os.path.join(d, "source.txt")
        if not os.path.exists(note):  # whole or absent: a note cut short would never be written again
            atomic_io.write_text(note, url + "\n")
        return d

    # --------------------------------------------------------------------------------------------- reads
    def pin(self, url: str, name: str, size: int, sha256: str) -> Pin:
        """Shard `name` of the dataset at `url`, downloaded if needed (once per node), pinned until release()."""
        try:
            return self._pin(url, name, size, sha256)
        except OSError as err:
            # a full disk can show first in the small files (source note, lock files), not only in the shard
            if err.errno == errno.ENOSPC:
                raise _disk_full(self.root, f"{name} of {url}") from err
            raise

    def _pin(self, url: str, name: str, size: int, sha256: str) -> Pin:
        d = self.source_dir(url)
        pin = _Flock(os.path.join(d, ".locks", name + ".pin"), fcntl.LOCK_SH)
        try:
            path = os.path.join(d, name)
            if not _current(d, name, size, sha256):
                with _Flock(os.path.join(d, ".locks", name + ".lock")):  # waits while a peer downloads it
                    if not _current(d, name, size, sha256, url=url):
                        self._download(url, d, name, size, sha256, wait_s=WAIT_FOR_ROOM_S)
                        STATS.add(misses=1)
                        return Pin(path, pin)
            STATS.add(hits=1)
            os.utime(path)
            return Pin(path, pin)
        except BaseException:
            pin.release()
            raise

    def prefetch(self, url: str, name: str, size: int, sha256: str) -> None:
        """Download shard `name` unless it is present, a peer is downloading it, or there is no room now (a full
        disk included: the reader's own pin() then reports it)."""
        try:
            self._prefetch(url, name, size, sha256)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
        except DataError as err:
            if not isinstance(err.__cause__, OSError) or err.__cause__.errno != errno.ENOSPC:
                raise

    def _prefetch(self, url: str, name: str, size: int, sha256: str) -> None:
        d = self.source_dir(url)
        if _current(d, name, size, sha256):
            return
        lock = _Flock.try_exclusive(os.path.join(d, ".locks", name + ".lock"))
        if lock is None:
            return  # a peer downloads it
        with lock:
            if not _current(d, name, size, sha256, url=url):
                try:
                    self._download(url, d, name, size, sha256, wait_s=0.0)
                except CacheFull:
                    return
                STATS.add(misses=1)

    # ----------------------------------------------------------------------------------------- download
    def _download(self, url: str, d: str, name: str, size: int, sha256: str, wait_s: float) -> None:
        """With the shard's download lock held: reserve room, fetch into .NAME.part, check, rename."""
        part = os.path.join(d, f".{name}.part")
        if os.path.exists(part):  # left by a killed process (we hold the download lock)
            os.remove(part)
        _forget(d, name)  # a stale shard (another dataset once at this URL) gives its room back
        if self.limit is not None and size > self.limit:
            raise DataError(
                f"shard {name} of {url} is {size / 1e9:.2f} GB, more than data.cache_limit_gb="
                f"{self.limit / 1e9:g}; raise data.cache_limit_gb"
            )
        deadline = time.monotonic() + wait_s
        while not self._reserve(part, size):
            if time.monotonic() >= deadline:
                if wait_s <= 0:
                    raise CacheFull
                raise DataError(
                    f"data.cache_limit_gb={self.limit / 1e9:g} is too small: the shards that the ranks "
                    f"of this node have open fill {self.root}, so {name} of {url} cannot be fetched; "
                    "raise data.cache_limit_gb (at least a few shards per rank)"
                )
            time.sleep(0.2)
        try:
            with open(part, "r+b") as out:
                remote.download(
                    remote.join(url, name), out, size, sha256, on_bytes=lambda n: STATS.add(bytes_fetched=n)
                )
            _record(d, name, sha256)  # before the rename: a shard in place always has its record
            with _Flock(os.path.join(self.root, ".cache.lock")):  # an accounting scan sees the old or the new name
                atomic_io.publish_file(part, os.path.join(d, name))
        except BaseException:
            try:
                os.remove(part)
            except OSError:
                pass
            raise

    def _reserve(self, part: str, size: int) -> bool:
        """Under the cache lock: evict until `size` more bytes fit, then allocate them as the .part file."""
        with _Flock(os.path.join(self.root, ".cache.lock")):
            if self.limit is not None and not self._make_room(size):
                return False
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if size:
                    os.posix_fallocate(fd, 0, size)
            except OSError as err:
                os.close(fd)
                os.remove(part)
                if err.errno == errno.ENOSPC:
                    raise _disk_full(self.root, f"{size / 1e6:.1f} MB") from err
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            else:
                os.close(fd)
            return True

    def usage(self) -> int:
        """Bytes held: finished shards plus the full size reserved by downloads in progress."""
        return sum(size for _, size, _, _ in self._entries())

    def _entries(self) -> list[tuple[float, int, str, str]]:
        """(mtime, size, directory, file name) of every shard and .part file in the cache."""
        out = []
        for sub in os.scandir(self.root):
            if not sub.is_dir() or sub.name.startswith("."):
                continue
            for entry in os.scandir(sub.path):
                if entry.is_file() and entry.name != "source.txt":
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    out.append((st.st_mtime, st.st_size, sub.path, entry.name))
        return out

    def _make_room(self, need: int) -> bool:
        entries = self._entries()
        total = sum(size for _, size, _, _ in entries)
        if total + need <= self.limit:
            return True
        parts = [e for e in entries if e[3].startswith(".") and e[3].endswith(".part")]
        shards = sorted(e for e in entries if not e[3].startswith("."))
        for _, size, d, fname in parts:  # .part files whose download lock nobody holds: a killed download
            lock = _Flock.try_exclusive(os.path.join(d, ".locks", fname[1 : -len(".part")] + ".lock"))
            if lock is not None:
                with lock:
                    os.remove(os.path.join(d, fname))
                total -= size
        for _, size, d, name in shards:  # least recently used first
            if total + need <= self.limit:
                break
            lock = _Flock.try_exclusive(os.path.join(d, ".locks", name + ".pin"))
            if lock is None:
                continue  # open in some reader
            with lock:
                _forget(d, name)  # the shard and its .verified record
            total -= size
        return total + need <= self.limit
