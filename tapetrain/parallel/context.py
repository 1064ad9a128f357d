"""Context parallelism: the model's SequenceShard over a ring of R groups, Ulysses inside each (R × U ranks).

The R·U ranks that share a sequence are consecutive (u = rank % U inside a Ulysses group, ring rank ρ = rank // U
inside the block of R·U): Ulysses groups are U consecutive ranks (one node's NVLink), rings join the ranks of equal u
across the U-groups (the network between nodes). Ring rank ρ holds chunks ρ and 2R−1−ρ of every sequence (T/R
tokens, tapetrain.parallel.ring); its Ulysses group splits those T/R tokens into U contiguous slices, so each rank
holds T/(R·U) tokens. Per layer: the Ulysses all-to-all gathers the ring rank's T/R tokens for H/U heads, the ring
computes their attention over all T keys, and the all-to-all returns this rank's tokens with all heads.

To the model this is one shard of N = R·U ranks (the loss's sums and RandPE's draw span them), which says which
tokens it holds (`tokens`), which query rows its attention computes (`queries`: the ring rank's) and with which heads
(`heads`: the Ulysses rank's H/U).
"""

from __future__ import annotations

from typing import Any

import torch

from tapetrain.model.sequence_shard import LocalAttention
from tapetrain.parallel.group_reductions import GroupReductions
from tapetrain.parallel.layout import ParallelLayout
from tapetrain.parallel.ring import Ring, ring_attention, ring_tokens


class RingShard(GroupReductions):
    """The SequenceShard of one rank of R × U (`ulysses` None for U = 1)."""

    def __init__(self, group: Any, rank: int, ring: Ring, ulysses: Any | None):
        self.group, self.rank = group, rank
        self.ring, self.ulysses = ring, ulysses
        self.ulysses_size = 1 if ulysses is None else ulysses.size
        self.size = ring.size * self.ulysses_size

    @property
    def head_split(self) -> int:
        """Only Ulysses splits the heads: keys travel around the ring at their own head count when U divides it."""
        return self.ulysses_size

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses_size

    def queries(self, length: int) -> torch.Tensor:
        """The ring rank's tokens (T/R,): the rows its attention computes."""
        return ring_tokens(self.ring.rank, self.ring.size, length)

    def tokens(self, length: int) -> torch.Tensor:
        """This rank's tokens (T/(R·U),): its Ulysses rank's contiguous part of the ring rank's."""
        per_rank = length // self.size
        return self.queries(length)[self.ulysses_rank * per_rank:(self.ulysses_rank + 1) * per_rank]

    def heads(self, n_heads: int) -> slice:
        per_rank = n_heads // self.ulysses_size
        return slice(self.ulysses_rank * per_rank, (self.ulysses_rank + 1) * per_rank)

    def attend(self, local_attention: LocalAttention, q: torch.Tensor, k: torch.Tensor,
               values: torch.Tensor) -> torch.Tensor:
        """q (B, T/N, H, D), k (B, T/N, Hk, D), values (B, T/N, Hv, Dv) token-major -> (B, T/N, H, Dv)."""
        inputs = local_attention.inputs

        def around_the_ring(q_ring: torch.Tensor, k_ring: torch.Tensor, values_ring: torch.Tensor) -> torch.Tensor:
            # the ring rank's T/R tokens of this rank's heads, token-major (B, T/R, h, ·) -> (B, T/R, h, Dv)
            out = ring_attention(self.ring, q_ring.transpose(1, 2), k_ring.transpose(1, 2),
                                 values_ring.transpose(1, 2), inputs)
            return out.transpose(1, 2)

        if self.ulysses is None:
            return around_the_ring(q, k, values)
        return self.ulysses.attend(LocalAttention(around_the_ring, inputs), q, k, values)


_groups: dict[tuple[int, int, int], tuple[dict[int, Any], dict[int, Any]]] = {}  # per layout: rank -> its groups


def _ring_and_ulysses_groups(layout: ParallelLayout) -> tuple[dict[int, Any], dict[int, Any]]:
    """Every ring's and every Ulysses group's process group (collective: all ranks create all of them, in one
    order), by member rank; made once per process and layout."""
    key = (layout.world_size, layout.sequence_parallel, layout.context_parallel)
    if key not in _groups:
        rings: dict[int, Any] = {}
        ulysses: dict[int, Any] = {}
        for members in layout.rings():
            group = torch.distributed.new_group(members)
            rings.update(dict.fromkeys(members, group))
        if layout.sequence_parallel > 1:
            for members in layout.ulysses_groups():
                group = torch.distributed.new_group(members)
                ulysses.update(dict.fromkeys(members, group))
        _groups[key] = (rings, ulysses)
    return _groups[key]


def init_ring_shard(layout: ParallelLayout, rank: int, sequence_group: Any, sequence_rank: int) -> RingShard:
    """The shard of global `rank` (collective): `sequence_group` is DeepSpeed's group of the N = R × U ranks that
    share its sequences, `sequence_rank` its rank there."""
    from tapetrain.parallel.ulysses import UlyssesShard

    rings, ulysses = _ring_and_ulysses_groups(layout)
    u = layout.sequence_parallel
    ring = Ring(rings[rank], sequence_rank // u, layout.context_parallel)
    inner = UlyssesShard(ulysses[rank], sequence_rank % u, u) if u > 1 else None
    return RingShard(sequence_group, sequence_rank, ring, inner)
