"""Background reading of the next micro batches (data.num_workers threads per rank).

The batch a micro step reads is a pure function of the iterator's position (tapetrain.data.batches), so threads
can read ahead without touching that position: the trainer still advances the BatchIterator one micro step at a
time, state_dict() still describes the last completed optimizer step, and a resume (load_state_dict) simply drops
what was read ahead. Batches are identical to reading in the training process.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tapetrain.data.batches import BatchIterator


class PrefetchingBatches:
    """Same interface as BatchIterator (next_micro_batch, state_dict, load_state_dict, grad_accum_steps, epoch,
    num_samples, consumed_samples); `num_workers` threads keep `2 * num_workers` micro batches in flight."""

    def __init__(self, batches: BatchIterator, num_workers: int):
        self.batches = batches
        self.depth = 2 * num_workers
        self._pool = ThreadPoolExecutor(num_workers, thread_name_prefix="tapetrain-data")
        self._ahead: deque[tuple[tuple[int, int, int], Future]] = deque()  # (position + k, batch)

    def __getattr__(self, name):  # grad_accum_steps, epoch, num_samples, consumed_samples, ...
        return getattr(self.batches, name)

    def _read(self, indices: np.ndarray) -> Any:
        return self.batches.read(indices)

    def _fill(self) -> None:
        b = self.batches
        start = len(self._ahead)
        for k in range(start, self.depth):
            key = (b.consumed_samples, b._micro_step, k)
            self._ahead.append((key, self._pool.submit(self._read, b.indices_ahead(k))))
        b.prefetch_ahead(self.depth)  # shards in object storage: fetched beyond what the threads read

    def next_micro_batch(self) -> Any:
        b = self.batches
        if self._ahead and self._ahead[0][0][:2] != (b.consumed_samples, b._micro_step):
            self._drop()  # the position moved (load_state_dict): what was read ahead is stale
        self._fill()
        _, future = self._ahead.popleft()
        batch = future.result()
        b.advance()
        # Keys record the position they were computed from; re-key what is left to the new position.
        self._ahead = deque(((b.consumed_samples, b._micro_step, i), f) for i, (_, f) in enumerate(self._ahead))
        return batch

    def _drop(self) -> None:
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()

    def state_dict(self) -> dict:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._drop()
        self.batches.load_state_dict(state)

    def close(self) -> None:
        self._drop()
        self._pool.shutdown(wait=True)
        self.batches.close()
