"""The two collectives every SequenceShard offers the model, over the ranks that share one sequence."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch


class GroupReductions:
    """`sum` and `same` over `group` (its first member is the source of `same`); subclasses set `group`."""

    group: Any

    @cached_property
    def source(self) -> int:
        """The global rank of the group's first member (looked up once, not on every `same`)."""
        return torch.distributed.get_global_rank(self.group, 0)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group (a detached copy; x itself is left as it was)."""
        total = x.detach().clone()
        torch.distributed.all_reduce(total, group=self.group)
        return total

    def same(self, x: torch.Tensor) -> torch.Tensor:
        """The group's first rank's x on every rank (a detached copy)."""
        shared = x.detach().contiguous().clone()
        torch.distributed.broadcast(shared, src=self.source, group=self.group)
        return shared
