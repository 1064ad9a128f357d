"""Which ranks share a sequence and which read the same samples: plain arithmetic, no process groups.

With W ranks and sequence parallelism N (parallel.sequence_parallel), ranks form W/N groups of N consecutive ranks
(DeepSpeed's parallel_state_sp builds them so): group g = ranks g·N ... g·N + N − 1. Every rank of a group reads
the same samples, those of data-parallel rank g = rank // N among W/N, and keeps slice rank % N of each sequence.
ZeRO partitions and gradient averaging still span all W ranks (DeepSpeed's sequence-data-parallel group).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    sequence_parallel: int = 1

    def __post_init__(self) -> None:
        if self.sequence_parallel < 1 or self.world_size % self.sequence_parallel:
            raise ValueError(f"sequence parallelism {self.sequence_parallel} does not divide {self.world_size} ranks")

    @property
    def data_parallel(self) -> int:
        """Ranks that read different samples: world size / N."""
        return self.world_size // self.sequence_parallel

    def data_parallel_rank(self, rank: int) -> int:
        return rank // self.sequence_parallel

    def sequence_rank(self, rank: int) -> int:
        """Which slice of each sequence `rank` holds."""
        return rank % self.sequence_parallel

    def groups(self) -> list[list[int]]:
        """The sequence-parallel groups: N consecutive ranks each."""
        n = self.sequence_parallel
        return [list(range(g * n, (g + 1) * n)) for g in range(self.data_parallel)]

    def describe(self, seq_len: int) -> list[str]:
        """Lines for --print-config and the start-up log."""
        n = self.sequence_parallel
        if n == 1:
            return [f"sequence parallel: off (parallel.sequence_parallel=1); {self.world_size} data-parallel rank(s)"]
        shown = self.groups()
        groups = " ".join(str(g) for g in shown[:8]) + (f" ... ({len(shown)} groups)" if len(shown) > 8 else "")
        return [
            f"sequence parallel: {n} (DeepSpeed-Ulysses): groups {groups}; each rank holds {seq_len // n} of every "
            f"sequence's {seq_len} tokens (group rank r: tokens [r*{seq_len // n}, (r+1)*{seq_len // n}))",
            f"data parallel: {self.data_parallel} (rank // {n}); the ranks of a group read the same samples; ZeRO "
            f"partitions and gradient averaging span all {self.world_size} ranks",
        ]
