"""Ring attention (context parallelism): exact attention of one rank's queries over a sequence spread on R ranks.

Each of the R ranks of a ring holds T/R tokens of every sequence, as two opposite chunks of T/(2R) tokens
(ring rank r: chunks r and 2R−1−r), so that under the causal mask every rank has the same amount of work (the early
chunk sees few keys, the late one many). Attention keeps the rank's queries and passes key and value blocks around
the ring: at step s rank r attends to the block of rank (r − s) mod R while the next block is already travelling
(isend/irecv, overlapping the transfer with the block's compute). Each block gives a partial output and its
log-sum-exp (LSE); partial outputs are merged by their LSEs, which is exactly the softmax over all keys.

    out = ring_attention(ring, q, k, values, inputs)     # q (B, h, T/R, D), k (B, hk, T/R, D), values (B, hv, T/R, Dv)

What travels: K at its own head count (GQA: a block is expanded to the query heads only where it is used) and the
values as the model gives them, TAPE's [V ‖ E] (2D wide) included, so A·V and A·E share one softmax on every block.
What does not: positions. Every rank knows the whole sequences' positions and document ids, so each block's mask
(causal by global token index, documents by id), bias rows (ALiBi, FIRE: `inputs.bias` holds this rank's query rows
over every key) and xPos decay are computed where the block is used. A block with no visible key (an earlier chunk
facing a later one, or other documents only) is not computed.

Backward is exact by recomputation per block (the forward keeps only q, the rank's own k and values, the merged
output and LSE: one K/V block in flight, never the whole sequence's): the blocks go around the ring again, each is
recomputed under autograd and differentiated with the share of the output gradient its LSE gives it; the gradients
of k and values travel with their block and arrive back at its owner after R steps.

Why not PyTorch's context parallelism (torch.distributed.tensor.experimental.context_parallel, torch 2.13): its
ring dispatches only SDPA's flash, memory-efficient and cuDNN CUDA kernels (no CPU kernel, so nothing runs over
gloo); the memory-efficient and cuDNN paths refuse an attention bias (no document mask, ALiBi or FIRE) and the
flash path takes values only as wide as the keys (TAPE's [V ‖ E] is twice as wide); its FlexAttention path
all-gathers K and V instead of passing them (the whole sequence's K/V on every rank) and has no CPU backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tapetrain.model.attention import expand_heads
from tapetrain.model.sequence_shard import AttentionInputs


def ring_tokens(ring_rank: int, ring_size: int, length: int, device: torch.device | None = None) -> torch.Tensor:
    """The global token indices ring rank r holds of a sequence of `length` tokens (a multiple of 2R): chunks r and
    2R−1−r of T/(2R) tokens each, in that order. (T/R,) int64."""
    chunk = length // (2 * ring_size)
    early = torch.arange(ring_rank * chunk, (ring_rank + 1) * chunk, device=device)
    late_first = (2 * ring_size - 1 - ring_rank) * chunk
    return torch.cat([early, torch.arange(late_first, late_first + chunk, device=device)])


@dataclass
class Ring:
    """One ring: its process group, this rank's place in it, and the sequences' length it splits."""

    group: Any  # torch.distributed ProcessGroup of the R ranks (ring ranks 0 ... R−1 in group order)
    rank: int
    size: int

    def __post_init__(self) -> None:
        self._next = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(self.group, (self.rank - 1) % self.size)

    def tokens(self, ring_rank: int, length: int, device: torch.device) -> torch.Tensor:
        return ring_tokens(ring_rank, self.size, length, device)

    def start_pass(self, tensors: tuple[torch.Tensor, ...]):
        """Send `tensors` to the next rank and receive the previous rank's (same shapes); returns a function that
        waits for the transfer and gives the received tensors."""
        received = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in tensors)  # contiguous
        ops = [dist.P2POp(dist.isend, x.contiguous(), self._next, self.group) for x in tensors]
        ops += [dist.P2POp(dist.irecv, x, self._prev, self.group) for x in received]
        requests = dist.batch_isend_irecv(ops)

        def finish() -> tuple[torch.Tensor, ...]:
            for request in requests:
                request.wait()
            return received

        return finish


# A block's attention materialises its scores: queries go through it in tiles of at most this many score elements
# (B·h·rows·keys), so what one block step allocates is bounded whatever T/R is (train/memory.py: ring_block_bytes).
TILE_SCORES = 2**25


def tile_rows(batch: int, heads: int, queries: int, keys: int) -> int:
    """Query rows per tile of a block of `keys` keys (all `queries` when they fit in TILE_SCORES)."""
    return max(1, min(queries, TILE_SCORES // max(1, batch * heads * keys)))


def _visible(rows: torch.Tensor, cols: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor | None:
    """(1|B, 1, Tq, Tk) bool: which keys (global indices `cols`) each query (global indices `rows`) may see;
    None = all of them."""
    allowed = (cols[None, :] <= rows[:, None])[None, None] if inputs.causal else None
    if inputs.docs is not None:
        ids = inputs.docs.k_ids  # (B, T): the whole sequences'
        same = (ids[:, rows][:, :, None] == ids[:, cols][:, None, :])[:, None]
        allowed = same if allowed is None else same & allowed
    return allowed


def _decayed_scores(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                    inputs: AttentionInputs) -> torch.Tensor:
    """q·kᵀ (B, h, Tq, Tk) fp32 with xPos's decay ζ^((p_i − p_j)/γ) on every logit, queries in blocks of γ rows
    each centred at its largest position (as tapetrain.model.xpos, so no factor exceeds 3.5)."""
    decay = inputs.decay
    positions = decay.k_pos  # (B, T) float64: the whole sequences' decay positions
    k_pos = positions[:, cols]
    parts = []
    for first in range(0, rows.shape[0], decay.block):
        q_pos = positions[:, rows[first:first + decay.block]]  # (B, Tb)
        centre = q_pos.max(dim=1, keepdim=True).values
        k_offset = centre - k_pos
        if inputs.causal:
            k_offset = k_offset.clamp(min=0)  # keys past the centre are masked: their factor is never used
        q_factor = (decay.zeta ** ((q_pos - centre) / decay.scale_base)[..., None])[:, None].float()  # (B,1,Tb,D)
        k_factor = (decay.zeta ** (k_offset / decay.scale_base)[..., None])[:, None].float()  # (B,1,Tk,D)
        parts.append(torch.matmul(q[:, :, first:first + decay.block] * q_factor, (k * k_factor).transpose(-1, -2)))
    return torch.cat(parts, dim=2)


def block_attention(q: torch.Tensor, k: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                    allowed: torch.Tensor | None, rows: torch.Tensor, cols: torch.Tensor,
                    inputs: AttentionInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: q (B, h, Tq, D), k (B, hk, Tk, D), values (B, hv, Tk, Dv), bias (1|B, h, Tq, Tk) or None ->
    (softmax-weighted values (B, h, Tq, Dv), LSE (B, h, Tq, 1)), both fp32; a query with no visible key here gets
    zeros and an LSE of −inf. Differentiable (the backward recomputes it)."""
    h = q.shape[1]
    q, k, values = q.float(), expand_heads(k, h).float(), expand_heads(values, h).float()
    scale = 1.0 / math.sqrt(q.shape[-1]) if inputs.scale is None else inputs.scale
    if inputs.decay is None:
        scores = torch.matmul(q, k.transpose(-1, -2))
    else:
        scores = _decayed_scores(q, k, rows, cols, inputs)
    scores = scores * scale
    if bias is not None:
        scores = scores + bias.float()
    if allowed is None:
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        return torch.matmul(torch.exp(scores - lse), values), lse
    seen = allowed.any(dim=-1, keepdim=True)  # (1|B, 1, Tq, 1): rows with a visible key in this block
    # Rows without one get finite dummy scores (no NaN in the LSE or its gradient), then zero weight.
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~seen, 0.0)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse).masked_fill(~seen, 0.0)
    return torch.matmul(probs, values), lse.masked_fill(~seen, float("-inf"))


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmaxes over disjoint keys -> the softmax over both (fp32)."""
    merged = torch.logaddexp(lse, block_lse)
    finite = torch.isfinite(merged)  # a row that has seen no key yet stays (0, −inf)
    safe = torch.where(finite, merged, torch.zeros_like(merged))
    weight_old = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(lse))
    weight_new = torch.where(finite, torch.exp(block_lse - safe), torch.zeros_like(lse))
    return out * weight_old + block_out * weight_new, merged


def _tiles(q: torch.Tensor, cols: torch.Tensor, allowed: torch.Tensor | None):
    """(row slice, its part of `allowed`) for each tile of this block's query rows that sees a key of it."""
    rows = tile_rows(q.shape[0], q.shape[1], q.shape[2], cols.shape[0])
    for first in range(0, q.shape[2], rows):
        tile = slice(first, first + rows)
        tile_allowed = None if allowed is None else allowed[..., tile, :]
        if tile_allowed is None or bool(tile_allowed.any()):
            yield tile, tile_allowed


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, values, bias, ring: Ring, inputs: AttentionInputs, length: int):
        rows = ring.tokens(ring.rank, length, q.device)
        b, h, tq, _ = q.shape
        out = torch.zeros(b, h, tq, values.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, tq, 1), float("-inf"), dtype=torch.float32, device=q.device)
        block = (k, values)
        for step in range(ring.size):
            pending = ring.start_pass(block) if step < ring.size - 1 else None
            owner = (ring.rank - step) % ring.size
            cols = ring.tokens(owner, length, q.device)
            allowed = _visible(rows, cols, inputs)
            for tile, tile_allowed in _tiles(q, cols, allowed):
                tile_bias = None if bias is None else bias[:, :, tile].index_select(-1, cols)
                block_out, block_lse = block_attention(q[:, :, tile], *block, tile_bias, tile_allowed, rows[tile],
                                                       cols, inputs)
                out[:, :, tile], lse[:, :, tile] = _merge(out[:, :, tile], lse[:, :, tile], block_out, block_lse)
            if pending is not None:
                block = pending()
        ctx.save_for_backward(q, k, values, bias, out, lse)
        ctx.ring, ctx.inputs, ctx.length = ring, inputs, length
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, values, bias, out, lse = ctx.saved_tensors
        ring, inputs, length = ctx.ring, ctx.inputs, ctx.length
        rows = ring.tokens(ring.rank, length, q.device)
        grad_out = grad_out.float()
        grad_q = torch.zeros_like(q, dtype=torch.float32)
        bias_needs_grad = bias is not None and ctx.needs_input_grad[3]
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias_needs_grad else None
        block = (k, values)
        grads = (torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(values, dtype=torch.float32))
        for step in range(ring.size):
            pending = ring.start_pass(block) if step < ring.size - 1 else None
            owner = (ring.rank - step) % ring.size
            cols = ring.tokens(owner, length, q.device)
            allowed = _visible(rows, cols, inputs)
            for tile, tile_allowed in _tiles(q, cols, allowed):
                leaves = [q[:, :, tile].detach().requires_grad_(), *(x.detach().requires_grad_() for x in block)]
                tile_bias = None if bias is None else bias[:, :, tile].index_select(-1, cols).detach()
                if bias_needs_grad:
                    tile_bias.requires_grad_()
                    leaves.append(tile_bias)
                with torch.enable_grad():
                    block_out, block_lse = block_attention(*leaves[:3], tile_bias, tile_allowed, rows[tile], cols,
                                                           inputs)
                # out = Σ_j w_j·o_j with w_j = exp(lse_j − lse): ∂/∂o_j = w_j·dout, ∂/∂lse_j = w_j·Σ dout·(o_j − out)
                weight = torch.exp(block_lse.detach() - lse[:, :, tile])
                tile_grad = grad_out[:, :, tile]
                grad_block_lse = weight * (tile_grad * (block_out.detach() - out[:, :, tile])).sum(-1, keepdim=True)
                found = torch.autograd.grad((block_out, block_lse), leaves, (weight * tile_grad, grad_block_lse))
                grad_q[:, :, tile] += found[0]
                grads = (grads[0] + found[1], grads[1] + found[2])
                if bias_needs_grad:
                    grad_bias[:, :, tile].index_add_(-1, cols, found[3])
            # the block's gradients travel on with it; after R steps they are back at its owner
            grads = ring.start_pass(grads)()
            if pending is not None:
                block = pending()
        return (grad_q.to(q.dtype), grads[0].to(k.dtype), grads[1].to(values.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None)


def ring_attention(ring: Ring, q: torch.Tensor, k: torch.Tensor, values: torch.Tensor,
                   inputs: AttentionInputs) -> torch.Tensor:
    """Attention of this ring rank's queries over the whole sequences, heads-first: q (B, h, T/R, D), k (B, hk, T/R,
    D), values (B, hv, T/R, Dv) (hk and hv dividing h), this rank's tokens (`ring_tokens`) -> (B, h, T/R, Dv).
    `inputs`: causality, scale, the bias rows of this rank's queries over all T keys (B|1, h, T/R, T), the xPos
    decay and the document ids (the whole sequences')."""
    length = q.shape[2] * ring.size
    if length % (2 * ring.size):
        raise ValueError(f"a ring of {ring.size} ranks splits each sequence into {2 * ring.size} equal chunks: "
                         f"{length} tokens is not a multiple of {2 * ring.size}")
    return _RingAttention.apply(q, k, values, inputs.bias, ring, inputs, length)
