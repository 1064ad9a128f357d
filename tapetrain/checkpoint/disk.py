"""Free disk space against what a checkpoint (or a rank-count conversion of one) is about to write.

Sizes, for P parameters of which T train, in the training dtype of b bytes (DeepSpeed 0.19.8's file layout):
  module weights        P·b        mp_rank_00_model_states.pt (ZeRO-3: only with gather_16bit_weights_on_model_save)
  optimizer             12·T       fp32 master weights + Adam's two moments, summed over the ranks' partitions
                                   (ZeRO-0 in fp32 keeps no master copy: 8·T, counted as 12·T all the same)
A universal conversion (resuming ZeRO-1/2 on another rank count) writes fp32 + moments per parameter once in its
scratch folder and once merged (24·T) next to a copy of the model states. Every estimate is padded by 5% plus
1 MiB per file for pickling overhead; the margin errs towards refusing, which costs a clear message, not a run.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from tapetrain.errors import DiskSpaceError

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_MIB = 1 << 20


def checkpoint_bytes(total_params: int, trainable_params: int, precision: str, zero_stage: int, world_size: int,
                     gather_16bit: bool = False) -> int:
    """Expected size of one checkpoint directory (all ranks' files)."""
    weights = total_params * DTYPE_BYTES[precision] if zero_stage < 3 or gather_16bit else 0
    files = 1 + 2 * world_size  # model states (per rank for ZeRO-3), optimizer partitions, RNG states
    return _padded(weights + 12 * trainable_params, files)


def universal_conversion_bytes(total_params: int, trainable_params: int, precision: str) -> int:
    """Expected peak size of DeepSpeed's universal conversion of one ZeRO-1/2 checkpoint."""
    return _padded(total_params * DTYPE_BYTES[precision] + 24 * trainable_params, 8)


def _padded(size: int, files: int) -> int:
    return math.ceil(size * 1.05) + files * _MIB


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes (for an unprivileged writer) on the filesystem holding `path` or its nearest existing parent."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def require_free_space(path: str | os.PathLike, needed: int, what: str) -> None:
    """Raise DiskSpaceError unless `needed` bytes are free where `path` lives."""
    free = free_bytes(path)
    if free < needed:
        raise DiskSpaceError(
            f"no space left for {what} in {path}: it needs about {human(needed)} ({needed} bytes) but only "
            f"{human(free)} ({free} bytes) are free. Free disk space there (delete old checkpoints, lower "
            "train.keep_last) or set run.out_dir to a larger filesystem, then start the same command again "
            "(train.resume=auto continues from the last complete checkpoint)"
        )
