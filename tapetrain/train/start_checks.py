"""Checks of a start that need no engine (what the kernels need is the execution plan's: model/execution_plan.py):
for --dry-run, what remote data would fail on later: the cache directory, the cache limit against the shard
sizes, every shard's presence. Each raises a one-line ConfigError or DataError naming the problem and the fix."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tapetrain.data.errors import DataError

if TYPE_CHECKING:
    from tapetrain.config import RunConfig

log = logging.getLogger("tapetrain.train")

HEAD_THREADS = 16  # concurrent HEAD requests: a dataset of thousands of shards is checked in seconds


def remote_sources(*datasets: Any) -> list[Any]:
    """The PackedDatasets read from object storage among `datasets` (mixtures opened up)."""
    out = []
    for ds in datasets:
        for one in getattr(ds, "datasets", [ds]) if ds is not None else []:
            if getattr(one, "remote", False):
                out.append(one)
    return out


def check_remote_data(cfg: RunConfig, train: Any, val: Any) -> None:
    """What reading the remote shards would fail on, found before the engine is built (--dry-run)."""
    from tapetrain.data.cache import ShardCache

    sources = remote_sources(train, val)
    if not sources:
        return
    cache = ShardCache(cfg.data.cache_dir, cfg.data.cache_limit_gb)
    _check_writable(cache.root)
    shards = [(ds.path, s["file"], s["num_tokens"] * ds.dtype.itemsize) for ds in sources for s in ds.shards]
    if cache.limit is not None:
        _check_limit(cache.limit, shards)
    _check_present(shards)


def _check_writable(root: str) -> None:
    existing = root
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        why = "read-only" if os.path.isdir(existing) else f"{existing} is not a directory"
        raise DataError(f"data.cache_dir {root} is not writable ({why}: {existing}); point data.cache_dir at a "
                        "writable node-local directory")


def _check_limit(limit: int, shards: list[tuple[str, str, int]]) -> None:
    url, name, largest = max(shards, key=lambda s: s[2])
    if limit < largest:
        raise DataError(f"data.cache_limit_gb={limit / 1e9:g} is smaller than shard {name} of {url} "
                        f"({largest / 1e9:.3g} GB); raise data.cache_limit_gb (at least a few shards per rank)")
    total = sum(size for _, _, size in shards)
    if limit < total:
        log.warning("data.cache_limit_gb=%g is smaller than the remote train and val shards (%.3g GB): shards are "
                    "evicted and fetched again every epoch", limit / 1e9, total / 1e9)


def _check_present(shards: list[tuple[str, str, int]]) -> None:
    """HEAD every shard (concurrently): it must exist with its manifest size."""
    from tapetrain.data import remote, remote_errors

    def head(shard: tuple[str, str, int]) -> str | None:
        url = remote.join(shard[0], shard[1])
        fs, path = remote.filesystem(url)
        try:
            size = fs.info(path).get("size")
        except Exception as err:  # noqa: BLE001 - described as the user's error below
            return str(remote_errors.describe(url, err))
        if size is not None and int(size) != shard[2]:
            return f"{url} has {size} bytes but its manifest lists {shard[2]}; re-upload the dataset"
        return None

    with ThreadPoolExecutor(HEAD_THREADS) as pool:
        problems = [p for p in pool.map(head, shards) if p]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DataError(problems[0] + more)
