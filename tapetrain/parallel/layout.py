"""Sequence-parallel layout helpers. ParallelLayout (which ranks share a sequence, plain arithmetic) lives in
tapetrain/rank_layout.py, below the process-group module that also needs it; it is re-exported here."""

from __future__ import annotations

from tapetrain.rank_layout import ParallelLayout

__all__ = ["ParallelLayout", "local_ranks_warning"]


def local_ranks_warning(sequence_parallel: int, ranks_per_node: int | None) -> str | None:
    """A warning when a sequence-parallel group cannot fit on one node (its all-to-alls would cross nodes)."""
    if not ranks_per_node or sequence_parallel <= ranks_per_node:
        return None
    return (f"parallel.sequence_parallel={sequence_parallel} is larger than the {ranks_per_node} GPU(s) per node: "
            "each group's all-to-all in every layer then crosses the network between nodes, which is much slower "
            "than NVLink; use at most the GPUs of one node (e.g. parallel.sequence_parallel="
            f"{_largest_divisor_at_most(sequence_parallel, ranks_per_node)}) and data parallelism across nodes")


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if n % d == 0)
