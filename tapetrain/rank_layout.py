"""Which ranks share a sequence and which read the same samples: plain arithmetic, no process groups.

With W ranks and sequence parallelism N (parallel.sequence_parallel), ranks form W/N groups of N consecutive ranks
(DeepSpeed's parallel_state_sp builds them so): group g = ranks g·N ... g·N + N − 1. Every rank of a group reads
the same samples, those of data-parallel rank g = rank // N among W/N, and keeps slice rank % N of each sequence.
ZeRO partitions and gradient averaging still span all W ranks (DeepSpeed's sequence-data-parallel group).

With context parallelism R (parallel.context_parallel) a sequence is shared by N = R × U consecutive ranks
(U = parallel.sequence_parallel): rank u + U·ρ of a block is Ulysses rank u of ring rank ρ. Ulysses groups are
U consecutive ranks, rings join the ranks of equal u (stride U).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    sequence_parallel: int = 1  # U: Ulysses
    context_parallel: int = 1  # R: the ring

    def __post_init__(self) -> None:
        if self.sequence_parallel < 1 or self.context_parallel < 1 or self.world_size % self.sequence_ranks:
            raise ValueError(f"sequence parallelism {self.sequence_parallel} × context parallelism "
                             f"{self.context_parallel} does not divide {self.world_size} ranks")

    @property
    def sequence_ranks(self) -> int:
        """N = R × U: the consecutive ranks that share each sequence."""
        return self.sequence_parallel * self.context_parallel

    @property
    def data_parallel(self) -> int:
        """Ranks that read different samples: world size / N."""
        return self.world_size // self.sequence_ranks

    def data_parallel_rank(self, rank: int) -> int:
        return rank // self.sequence_ranks

    def sequence_rank(self, rank: int) -> int:
        """`rank`'s place among the N ranks that share its sequences."""
        return rank % self.sequence_ranks

    def groups(self) -> list[list[int]]:
        """The groups of N consecutive ranks that share sequences."""
        n = self.sequence_ranks
        return [list(range(g * n, (g + 1) * n)) for g in range(self.data_parallel)]

    def ulysses_groups(self) -> list[list[int]]:
        """U consecutive ranks each (inside a node)."""
        u = self.sequence_parallel
        return [list(range(g * u, (g + 1) * u)) for g in range(self.world_size // u)]

    def rings(self) -> list[list[int]]:
        """R ranks each, of equal Ulysses rank in one block of N (stride U), in ring order."""
        u, n = self.sequence_parallel, self.sequence_ranks
        return [list(range(block * n + i, (block + 1) * n, u)) for block in range(self.data_parallel) for i in range(u)]

    def describe(self, seq_len: int) -> list[str]:
        """Lines for --print-config and the start-up log."""
        if self.context_parallel > 1:
            return self._describe_ring(seq_len)
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

    def _describe_ring(self, seq_len: int) -> list[str]:
        r, u, n = self.context_parallel, self.sequence_parallel, self.sequence_ranks

        def shown(groups: list[list[int]]) -> str:
            return " ".join(str(g) for g in groups[:8]) + (f" ... ({len(groups)} groups)" if len(groups) > 8 else "")

        chunk = seq_len // (2 * r)
        lines = [f"context parallel: {r} (ring attention): rings {shown(self.rings())}; ring rank p holds chunks p and "
                 f"{2 * r - 1}-p of {chunk} tokens of every sequence's {seq_len} ({seq_len // r} tokens); one K/V "
                 "block travels around the ring per step"]
        if u > 1:
            lines.append(f"sequence parallel: {u} (DeepSpeed-Ulysses) inside each ring rank: groups "
                         f"{shown(self.ulysses_groups())}; each rank holds {seq_len // n} of its ring rank's tokens")
        lines.append(f"data parallel: {self.data_parallel} (rank // {n}); the {n} ranks of a group "
                     f"{shown(self.groups())} read the same samples; ZeRO partitions and gradient averaging span all "
                     f"{self.world_size} ranks")
        return lines
