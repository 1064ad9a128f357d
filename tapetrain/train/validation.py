"""Which validation samples each rank evaluates: the same samples whatever the number of ranks.

One evaluation reads the first `train.eval_steps × train.global_batch_size` samples of the validation split (in
order, capped at its size). Sample i goes to rank i % world_size, so the sum of token losses over all ranks, and
hence val_loss, depends only on the weights (up to float summation order). Every rank runs the same number of
forward passes (ZeRO-3 gathers parameters in each one); a rank with nothing left runs one sample at weight 0.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class ValBatch(NamedTuple):
    indices: np.ndarray  # (b,) dataset indices of the validation split
    weight: float  # 1.0, or 0.0 for the padding forward of a rank that has no samples left


def eval_sample_count(num_val_samples: int, eval_steps: int, global_batch_size: int) -> int:
    return min(num_val_samples, eval_steps * global_batch_size)


def rank_val_batches(count: int, micro_batch_size: int, rank: int, world_size: int) -> list[ValBatch]:
    """This rank's micro batches over samples rank, rank + world_size, ... < count."""
    mine = np.arange(rank, count, world_size, dtype=np.int64)
    per_rank = -(-count // world_size)  # the most samples any rank holds
    batches = []
    for b in range(-(-per_rank // micro_batch_size)):
        indices = mine[b * micro_batch_size:(b + 1) * micro_batch_size]
        if len(indices):
            batches.append(ValBatch(indices, 1.0))
        else:
            batches.append(ValBatch(np.zeros(1, dtype=np.int64), 0.0))
    return batches
