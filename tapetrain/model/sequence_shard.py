"""Sequence parallelism as the model sees it: each rank of a group holds one contiguous slice of every sequence.

With N ranks in a group, group rank r holds tokens [r·T/N, (r+1)·T/N) of each of the B sequences. Everything in
the model works per token (embeddings, norms, projections, SwiGLU, TAPE's rotations and both state updates, the
loss) except attention and what is positional across the whole sequence, so the model asks its shard for three
things only:

    attend   the Ulysses exchange: token slices of all heads in, whole sequences of H/N heads to a local attention
             function, token slices of all heads back
    sum      a sum over the group, without gradient (the loss's token counts and the group's loss)
    same     a tensor as the group's first rank holds it (RandPE: one draw of positions per sequence)

A shard may also say which tokens it holds, which query rows its local attention computes and with which heads
(`tokens`, `queries`, `heads`); without them it holds one contiguous slice and attends with whole sequences of H/N
heads, as Ulysses does. A context-parallel (ring) shard holds two opposite chunks of every sequence and computes
attention itself, block by block, from the `AttentionInputs` the local attention carries.

`tapetrain.parallel` implements it over DeepSpeed-Ulysses; the model never imports that (it stays plain PyTorch).
A model is given its shard with `Transformer.shard_sequence`; training and evaluation use it alike. Without one the
model runs the same forward with `WHOLE_SEQUENCE`, the group of one rank that holds every token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tapetrain.model.documents import DocumentMask
from tapetrain.model.loss import count_targets
from tapetrain.model.xpos import XposDecay

# (q, k, values) of whole sequences for this rank's heads, token-major (B, T, h, ·) -> (B, T, h, Dv)
AttentionFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AttentionInputs:
    """What attention needs besides q, k and values, for a shard that computes it itself (a ring, block by block).

    bias    (1|B, h, Tq, T) this rank's heads and query rows (`local_queries`) over every key, or None
    decay   xPos: its k_pos are the whole sequences' decay positions (B, T)
    docs    the whole sequences' document ids (k_ids, (B, T)), or None
    """

    causal: bool
    scale: float | None
    bias: torch.Tensor | None = None
    decay: XposDecay | None = None
    docs: DocumentMask | None = None


@dataclass(frozen=True)
class LocalAttention:
    """The local attention a shard is given: call it on whole sequences (Ulysses), or read its `inputs` (a ring)."""

    function: AttentionFunction
    inputs: AttentionInputs

    def __call__(self, q: torch.Tensor, k: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return self.function(q, k, values)


class SequenceShard(Protocol):
    rank: int  # this rank's slice of every sequence (its rank in the group)
    size: int  # N, ranks in the group

    def attend(self, local_attention: LocalAttention, q: torch.Tensor, k: torch.Tensor,
               values: torch.Tensor) -> torch.Tensor:
        """q (B, T/N, H, D), k (B, T/N, Hk, D), values (B, T/N, Hv, Dv), token-major slices, with H, Hk and Hv
        multiples of N -> (B, T/N, H, Dv). `local_attention` runs on whole sequences of this rank's H/N heads (and
        Hk/N, Hv/N of the keys and values), heads r·H/N ... (r+1)·H/N − 1."""
        ...

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the group (a new tensor, no gradient)."""
        ...

    def same(self, x: torch.Tensor) -> torch.Tensor:
        """x as the group's first rank holds it (a new tensor, no gradient)."""
        ...


class WholeSequence:
    """The shard of a forward without sequence parallelism: one rank holding all T tokens, attending with all heads."""

    rank, size = 0, 1

    def attend(self, local_attention: LocalAttention, q: torch.Tensor, k: torch.Tensor,
               values: torch.Tensor) -> torch.Tensor:
        return local_attention(q, k, values)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone()

    def same(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone()


WHOLE_SEQUENCE = WholeSequence()


def _contiguous(shard: SequenceShard, length: int) -> slice:
    per_rank = length // shard.size
    return slice(shard.rank * per_rank, (shard.rank + 1) * per_rank)


def local_tokens(shard: SequenceShard, length: int) -> slice | torch.Tensor:
    """This rank's tokens of a sequence of `length` tokens (a multiple of shard.size): a contiguous slice, or the
    global token indices (T/N,) of a shard that says otherwise (`tokens`: a ring's two opposite chunks)."""
    tokens = getattr(shard, "tokens", None)
    return _contiguous(shard, length) if tokens is None else tokens(length)


def local_queries(shard: SequenceShard, length: int) -> slice | torch.Tensor:
    """The query rows (of a sequence of `length` tokens) this rank's local attention computes: the whole sequence
    for Ulysses and one rank (`slice(None)`), the tokens of its ring rank for a ring (`queries`)."""
    queries = getattr(shard, "queries", None)
    return slice(None) if queries is None else queries(length)


def local_heads(shard: SequenceShard, n_heads: int) -> slice:
    """The query heads this rank attends with inside `attend` (n_heads a multiple of shard.size, or of the shard's
    own head split: `heads`)."""
    heads = getattr(shard, "heads", None)
    return _contiguous(shard, n_heads) if heads is None else heads(n_heads)


def head_split(shard: SequenceShard) -> int:
    """How many ranks split the heads inside `attend` (N for Ulysses; a ring splits none: only its U)."""
    return getattr(shard, "head_split", shard.size)


def kept_tokens(shard: SequenceShard, tokens: int, keep: int) -> slice | torch.Tensor:
    """This rank's part of the whole sequences' last `keep` positions (all its `tokens` for keep <= 0), as a slice of
    (or indices into) its own tokens: empty on a rank that holds none of them."""
    if keep <= 0:
        return slice(None)
    held = local_tokens(shard, tokens * shard.size)
    if isinstance(held, torch.Tensor):
        return torch.nonzero(held >= tokens * shard.size - keep).flatten()
    kept_from = max(0, tokens * shard.size - keep) - shard.rank * tokens
    return slice(min(max(0, kept_from), tokens), None)


def whole_sequence_mean(shard: SequenceShard, labels: torch.Tensor,
                        mean: Callable[[torch.Tensor | None], torch.Tensor]) -> torch.Tensor:
    """The mean loss over the whole sequences' labels, of which `labels` (B, T/N) are this rank's slice.

    mean(count) is this slice's loss sum over `count` (None: over its own labels, which for one rank are all of
    them). With N > 1 the value is the group's mean (the same on every rank: logged, checked for NaN) and the
    gradient this slice's share of it, so that the group's gradients add up to those of one rank holding the whole
    sequences.
    """
    if shard.size == 1:
        return mean(None)
    share = mean(shard.sum(count_targets(labels)))  # the divisor: labels of the whole sequences
    return share + (shard.sum(share) - share.detach())
