"""BatchIterator: one global, seeded sample order sliced per data-parallel rank; resume is O(1).

Global sample slots g = 0, 1, 2, ... map to dataset indices through SampleOrder (tapetrain.data.order).
With G = global_batch_size, mb = micro_batch_size, W = world_size: optimizer step s owns slots
[s*G, (s+1)*G); its micro-step m on rank r reads slots s*G + (m*W + r)*mb + [0, mb). The samples of a step
are therefore the same for any W at the same G, and the whole state is `consumed_samples` (global samples of
completed optimizer steps): a restarted run sets it and continues exactly, with no replay.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from tapetrain.data.errors import DataError
from tapetrain.data.order import SampleOrder

STATE_VERSION = 1


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise DataError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def read_batch(dataset: Any, indices: np.ndarray) -> Any:
    """The batch of these dataset indices: (len(indices), seq_len + 1) int64 token windows, or what the dataset's
    `collate` makes of its samples (an ExampleBatch for supervised examples)."""
    samples = [dataset[int(i)] for i in indices]
    collate = getattr(dataset, "collate", None)
    return collate(samples) if collate is not None else torch.from_numpy(np.stack(samples))


class BatchIterator:
    """Deterministic shuffled global sample order, sliced per data-parallel rank."""

    def __init__(
        self,
        dataset: Any,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        consumed_samples: int = 0,
    ):
        self.global_batch_size = _positive("train.global_batch_size", global_batch_size)
        self.micro_batch_size = _positive("train.micro_batch_size", micro_batch_size)
        self.world_size = _positive("world_size", world_size)
        if not 0 <= rank < self.world_size:
            raise DataError(f"rank {rank} is outside [0, world_size={world_size})")
        if int(seed) < 0:
            raise DataError(f"data seed must be >= 0, got {seed}")
        if consumed_samples < 0:
            raise DataError(f"consumed_samples must be >= 0, got {consumed_samples}")
        per_micro_step = self.micro_batch_size * self.world_size
        if self.global_batch_size % per_micro_step:
            valid = max(per_micro_step, round(self.global_batch_size / per_micro_step) * per_micro_step)
            raise DataError(
                f"train.global_batch_size={global_batch_size} is not divisible by train.micro_batch_size="
                f"{micro_batch_size} x world_size={world_size} = {per_micro_step}; set "
                f"train.global_batch_size to a multiple of {per_micro_step} (e.g. {valid}) or change "
                "train.micro_batch_size"
            )
        self.grad_accum_steps = self.global_batch_size // per_micro_step
        self.dataset, self.rank, self.seed, self.shuffle = dataset, rank, int(seed), shuffle
        self.num_samples = int(dataset.num_samples)
        self._order = SampleOrder(self.num_samples, self.seed, shuffle)
        self.consumed_samples = int(consumed_samples)
        self._micro_step = 0  # micro-steps of the current (uncompleted) optimizer step already returned
        self._hinted = 0  # absolute micro step up to which prefetch_ahead told the dataset what comes

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_samples

    def micro_batch_indices(self) -> np.ndarray:
        """Dataset indices (micro_batch_size,) of the next micro batch, without advancing."""
        return self.indices_ahead(0)

    def indices_ahead(self, k: int) -> np.ndarray:
        """Dataset indices (micro_batch_size,) of the micro batch `k` micro steps after the next one."""
        return self._order(self.slots_ahead(k))

    def slots_ahead(self, k: int) -> np.ndarray:
        """Global sample slots (micro_batch_size,) of the micro batch `k` micro steps after the next one: the same
        samples have the same slots on any number of ranks (what per-sample random draws are keyed on)."""
        mb = self.micro_batch_size
        steps, micro = divmod(self._micro_step + k, self.grad_accum_steps)
        first = self.consumed_samples + steps * self.global_batch_size + (micro * self.world_size + self.rank) * mb
        return np.arange(first, first + mb, dtype=np.int64)

    def read(self, indices: np.ndarray) -> Any:
        """The micro batch of these dataset indices (see `read_batch`)."""
        return read_batch(self.dataset, indices)

    def prefetch_ahead(self, first: int, count: int | None = None) -> None:
        """Tell the dataset which samples micro steps first .. first + count - 1 ahead will read (count defaults to
        two optimizer steps), so remote shards are fetched before they are needed; a no-op for local data."""
        if not getattr(self.dataset, "fetches_remote", False):
            return
        count = 2 * self.grad_accum_steps if count is None else count
        now = self.consumed_samples // self.global_batch_size * self.grad_accum_steps + self._micro_step
        start = max(first, self._hinted - now)  # micro steps hinted by an earlier call are not hinted again
        if start < first + count:
            self.dataset.prefetch(np.concatenate([self.indices_ahead(k) for k in range(start, first + count)]))
            self._hinted = now + first + count

    def advance(self) -> None:
        """Move past one micro step (what next_micro_batch does after reading)."""
        self._micro_step += 1
        if self._micro_step == self.grad_accum_steps:
            self._micro_step = 0
            self.consumed_samples += self.global_batch_size

    def next_micro_batch(self) -> Any:
        """The next micro batch (see `read`); after grad_accum_steps calls the step is complete."""
        self.prefetch_ahead(1)
        batch = self.read(self.micro_batch_indices())
        self.advance()
        return batch

    def close(self) -> None:
        """Stop the dataset's background fetches (remote data); reading again restarts them."""
        close = getattr(self.dataset, "close", None)
        if close is not None:
            close()

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Any:
        return self.next_micro_batch()

    def state_dict(self) -> dict[str, Any]:
        """State at the last completed optimizer step (a partially consumed step is redone after resume)."""
        return {
            "version": STATE_VERSION,
            "consumed_samples": self.consumed_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """O(1): continue at state["consumed_samples"]; the order must come from the same seed/shuffle."""
        if "consumed_samples" not in state:
            raise DataError(f"data state {state} has no consumed_samples; pass the dict from state_dict()")
        if state.get("seed", self.seed) != self.seed or state.get("shuffle", self.shuffle) != self.shuffle:
            raise DataError(
                f"checkpoint data order used seed={state.get('seed')} shuffle={state.get('shuffle')} but "
                f"this run has seed={self.seed} shuffle={self.shuffle}; set run.seed={state.get('seed')} "
                "to resume exactly (with run.out_dir set too: a run.seed override alone starts OUT_DIR/seed-S)"
            )
        if state.get("num_samples", self.num_samples) != self.num_samples:
            warnings.warn(
                f"checkpoint data had {state['num_samples']} samples, this dataset has {self.num_samples}: "
                "the data changed, so the resumed order differs from the original run", stacklevel=2)
        self.consumed_samples = int(state["consumed_samples"])
        self._micro_step = 0
        self._hinted = 0
