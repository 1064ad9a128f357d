"""The shards of one remote split as the reader sees them: fetched through the node's ShardCache, a few mapped.

A shard is mapped (and pinned in the cache, so no rank of the node evicts it) while it is among the `max_open` most
recently read; reads in progress hold it too. `prefetch` downloads the shards that the next samples need in
background threads (the sample order is known in advance), so a warm reader waits for nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

from tapetrain.data.cache import STATS, Pin, ShardCache

log = logging.getLogger("tapetrain.data")

PREFETCH_THREADS = 4
MAX_OPEN = 32


def max_open_shards(cache: ShardCache, shard_bytes: int) -> int:
    """Shards one reader keeps mapped: a quarter of what the limit holds per rank of the node (at least 2), so
    mapped shards of every rank plus the prefetched ones fit."""
    if cache.limit is None:
        return MAX_OPEN
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return int(max(2, min(MAX_OPEN, cache.limit // max(1, 4 * local_ranks * shard_bytes))))


class RemoteShards:
    """Memory maps of the shards of `url` (a list of manifest entries), opened through `cache`."""

    def __init__(self, url: str, shards: list[dict[str, Any]], dtype: np.dtype, cache: ShardCache):
        self.url, self.shards, self.dtype, self.cache = url, shards, dtype, cache
        largest = max(s["num_tokens"] for s in shards) * dtype.itemsize
        self.max_open = max_open_shards(cache, largest)
        STATS.active = True
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._open: OrderedDict[int, tuple[np.memmap, Pin]] = OrderedDict()  # least recently used first
        self._users: dict[int, int] = {}  # reads in progress per shard
        self._queued: set[int] = set()
        self._pool: ThreadPoolExecutor | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in ("url", "shards", "dtype", "cache", "max_open")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def _entry(self, k: int) -> tuple[str, int, str]:
        s = self.shards[k]
        return s["file"], s["num_tokens"] * self.dtype.itemsize, s["sha256"]

    @contextmanager
    def use(self, k: int) -> Iterator[np.memmap]:
        """Shard k mapped for the duration of the block (downloaded first if the cache lacks it)."""
        with self._lock:
            self._users[k] = self._users.get(k, 0) + 1
            opened = self._open.get(k)
            if opened is not None:
                self._open.move_to_end(k)
        try:
            if opened is None:
                opened = self._map(k)
            yield opened[0]
        finally:
            with self._lock:
                self._users[k] -= 1
                if len(self._open) > self.max_open:
                    self._close_surplus()

    def _map(self, k: int) -> tuple[np.memmap, Pin]:
        pin = self.cache.pin(self.url, *self._entry(k))  # outside the lock: may download
        mapped = (np.memmap(pin.path, dtype=self.dtype, mode="r"), pin)
        with self._lock:
            if k in self._open:  # another thread mapped it meanwhile
                pin.release()
                return self._open[k]
            self._open[k] = mapped
        return mapped

    def _close_surplus(self) -> None:
        """With the lock held: unmap least recently used shards beyond max_open that no read is using."""
        for k in list(self._open):
            if len(self._open) <= self.max_open:
                break
            if self._users.get(k, 0) == 0:
                _, pin = self._open.pop(k)
                pin.release()  # the memmap is freed with its last reference

    def prefetch(self, ks: Iterable[int]) -> None:
        """Download these shards in the background (best effort: a failure surfaces when the shard is read)."""
        for k in ks:
            k = int(k)
            with self._lock:
                if k in self._open or k in self._queued:
                    continue
                self._queued.add(k)
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="tapetrain-fetch")
            self._pool.submit(self._prefetch_one, k)

    def _prefetch_one(self, k: int) -> None:
        try:
            self.cache.prefetch(self.url, *self._entry(k))
        except Exception as err:  # reported by the read that needs the shard
            log.debug("prefetch of %s/%s failed: %s", self.url, self.shards[k]["file"], err)
        finally:
            with self._lock:
                self._queued.discard(k)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        with self._lock:
            for _, pin in self._open.values():
                pin.release()
            self._open.clear()
