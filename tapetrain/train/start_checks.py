"""Checks of a start that need no engine: an attention backend or fused TAPE updates this machine cannot run, and
(for --dry-run) what remote data would fail on later: the cache directory, the cache limit against the shard
sizes, every shard's presence. Each raises a one-line ConfigError or DataError naming the problem and the fix."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tapetrain.data.errors import DataError
from tapetrain.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from tapetrain.config import RunConfig
    from tapetrain.model import ModelConfig

log = logging.getLogger("tapetrain.train")

HEAD_THREADS = 16  # concurrent HEAD requests: a dataset of thousands of shards is checked in seconds


def check_attention_backend(model_config: ModelConfig, device: torch.device) -> None:
    """An explicitly chosen backend must run here (before: the dry run passed, then step 1 raised, exit 70)."""
    from tapetrain.model.attention import backend_available

    name = model_config.attn_backend
    if name not in ("auto", "eager", "sdpa") and not backend_available(name, device):
        needs = {"flash": "a CUDA GPU and flash-attn", "triton": "a CUDA GPU and triton",
                 "flex": "torch's FlexAttention"}.get(name, name)
        raise ConfigError(f"model.attn_backend={name} cannot run on this {device.type} machine (it needs {needs}); "
                          "use model.attn_backend=auto (or sdpa), or run on a machine that has it")


def check_fused_updates(model_config: ModelConfig, device: torch.device) -> None:
    """model.tape_fused_updates=true must be able to run its kernels here (else step 1 would raise)."""
    from tapetrain.model.tape_fused import cannot_run_reason

    if model_config.pe == "tape" and model_config.tape_fused_updates is True:
        reason = cannot_run_reason(device)
        if reason is not None:
            raise ConfigError(f"model.tape_fused_updates=true cannot run on this {device.type} machine: {reason}")


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
