"""Positional encodings: RoPE angles, TAPE's initial state, and the baselines' rotations and biases.

Pairing is Hugging Face Llama's rotate-half: dims f and f + F (F = D/2) form frequency pair f, so Llama weights load
without permutation. A pair (x1, x2) rotated by a block (c, s) becomes (x1·c − x2·s, x2·c + x1·s).

Everything position-dependent that layers share is computed once per forward into a `PositionContext`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tapetrain.model.config import ModelConfig
from tapetrain.model.documents import DocumentMask, document_positions
from tapetrain.model.fire import FireBias
from tapetrain.model.randpe import draw_document_positions, draw_positions, randpe_limit
from tapetrain.model.rope_scaling import frequencies_for
from tapetrain.model.sequence_shard import (
    WHOLE_SEQUENCE,
    SequenceShard,
    local_heads,
    local_queries,
    local_tokens,
)
from tapetrain.model.xpos import XposDecay, xpos_zeta


@dataclass
class PositionContext:
    """Per-forward positional inputs shared by all layers.

    positions      (B, T) float64  absolute (offset-included, not yet interpolated) positions of the new tokens
    key_positions  (B, S) float64  positions of every key (cached + new)
    inv_freq       (F,) float64    this forward's rotary frequencies (model.rope_scaling; rotary encodings only)
    cos, sin       (B, 1, T, F)    rotary tables for rope/randpe/xpos (model dtype)
    xpos           XposDecay       xpos: the decay, applied inside attention block by block (tapetrain.model.xpos)
    bias           (1|B, H, T, S)  additive attention bias for alibi/fire
    tape_init      (B, T, M, D)    TAPE's E^(0), token-major like E everywhere: [c ‖ s] per token and head
    shard          SequenceShard   `positions` are its slice of T/N tokens of every sequence (N = 1: all of them);
                                   with N > 1 `key_positions` are the whole sequence (B, T) and attention runs on
                                   whole sequences for H/N heads, so xpos and bias span them for those heads
    docs           DocumentMask    packed documents (data.document_mask; None without): positions restart per
                                   document, attention stays inside one; always the whole sequences
    """

    positions: torch.Tensor
    key_positions: torch.Tensor
    inv_freq: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    xpos: XposDecay | None = None
    resample_randpe: bool = False  # randpe drawing per layer: rotate_qk draws this layer's positions
    bias: torch.Tensor | None = None
    tape_init: torch.Tensor | None = None
    shard: SequenceShard = WHOLE_SEQUENCE
    docs: DocumentMask | None = None

    @property
    def query_positions(self) -> torch.Tensor:
        """Positions of the queries attention computes: the new tokens, or with N > 1 the whole sequence (a ring:
        its ring rank's tokens, `local_queries`)."""
        if self.shard.size == 1:
            return self.positions
        return self.key_positions[:, local_queries(self.shard, self.key_positions.shape[1])]

    def own_heads(self, per_head: torch.Tensor) -> torch.Tensor:
        """(B, H, ...) -> the heads this rank attends with (all for N = 1)."""
        return per_head if self.shard.size == 1 else per_head[:, local_heads(self.shard, per_head.shape[1])]


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of p·θ_f for positions p (..., T) and frequencies θ_f (F,) (rope_scaling.frequencies_for);
    (..., T) -> (..., T, F) float64.

    Computed in float64: fp32 angles at positions in the thousands are off by ~1e-4 rad, enough to break the
    exact shift-invariance of TAPE that the tests check.
    """
    angles = positions.to(torch.float64)[..., None] * inv_freq.to(torch.float64)
    return torch.cos(angles), torch.sin(angles)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate rotate-half pairs of x (..., D) by blocks (cos, sin) (..., F); broadcasting over heads/batch."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's geometric head slopes (Press et al.), with the standard interleave for non-powers of two."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


class PositionalEncoding(nn.Module):
    """Builds the PositionContext for one forward pass, for any `cfg.pe`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.kind = cfg.pe
        if self.kind == "fire" and cfg.fire_shared:  # otherwise every DecoderLayer holds its own (the baseline)
            self.fire = FireBias(cfg.n_heads, cfg.fire_hidden, cfg.fire_init_c, cfg.fire_init_threshold)

    @property
    def rotary(self) -> bool:
        return self.kind in ("rope", "randpe", "xpos")

    @property
    def samples_positions(self) -> bool:
        """Whether a forward without a cache or explicit positions draws random positions (randpe)."""
        return self.kind == "randpe" and (self.training or self.cfg.randpe_sample_at_eval)

    def default_positions(
        self, batch: int, length: int, past: int, offset: int, device: torch.device, sample: bool = False,
        shard: SequenceShard = WHOLE_SEQUENCE,
    ) -> torch.Tensor:
        """(B, T) float64 positions of new tokens: past + arange(T) + offset, or with `sample` (randpe, one draw
        for all layers) a sorted random draw + offset, the same for every row and every rank of the `shard`'s
        group (T is the whole sequence)."""
        if sample and not self.cfg.randpe_per_layer:
            draw = draw_positions(length, randpe_limit(self.cfg.randpe_max_position, self.cfg.max_seq_len), device)
            return (shard.same(draw) + offset).expand(batch, length)
        pos = torch.arange(past, past + length, device=device, dtype=torch.float64) + offset
        return pos.expand(batch, length)

    def document_positions(self, docs: DocumentMask, offset: int, sample: bool = False,
                           shard: SequenceShard = WHOLE_SEQUENCE) -> torch.Tensor:
        """(B, T) float64 positions of packed documents: restarting at 0 (+ offset) per document, or with `sample`
        (randpe, one draw for all layers) one sorted random draw per document (the same on every rank of the
        `shard`'s group; docs are the whole sequences')."""
        if not (sample and not self.cfg.randpe_per_layer):
            return document_positions(docs.q_ids) + offset
        draw = draw_document_positions(docs.q_ids, self._randpe_limit)
        return shard.same(draw) + offset

    @property
    def _randpe_limit(self) -> int:
        return randpe_limit(self.cfg.randpe_max_position, self.cfg.max_seq_len)

    def context(
        self, positions: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype, sample: bool = False,
        shard: SequenceShard = WHOLE_SEQUENCE, docs: DocumentMask | None = None,
    ) -> PositionContext:
        """Everything positional the layers share. `sample`: randpe draws positions (per layer: in rotate_qk).
        `positions` are the `shard`'s tokens, `key_positions` those of every key. With `docs`
        the positions are already per document (tapetrain.model.documents.document_positions)."""
        cfg = self.cfg
        ctx = PositionContext(positions=positions, key_positions=key_positions, shard=shard, docs=docs)
        ctx.resample_randpe = sample and cfg.randpe_per_layer
        if self.kind in ("rope", "randpe", "xpos", "tape"):
            # Every rotary angle (RoPE, TAPE's E^(0), RandPE, xPos) comes from these frequencies (rope_scaling.py).
            ctx.inv_freq = frequencies_for(cfg.head_dim, cfg.rope_parameters, key_positions)  # (F,)
        if self.kind in ("rope", "randpe", "xpos", "tape") and not ctx.resample_randpe:
            cos, sin = rope_angles(positions, ctx.inv_freq)  # (B, T, F)
            if self.kind == "tape":
                e0 = torch.cat([cos, sin], dim=-1).to(dtype)  # (B, T, D)
                ctx.tape_init = e0[:, :, None].expand(-1, -1, cfg.n_heads, -1)  # (B, T, M, D) view, no copy
            else:
                ctx.cos, ctx.sin = cos[:, None].to(dtype), sin[:, None].to(dtype)  # (B, 1, T, F)
        queries = ctx.query_positions  # what attention computes: with N > 1, the whole sequence
        if self.kind == "xpos":
            zeta = xpos_zeta(cfg.head_dim, positions.device)
            decay_q, decay_k = queries, key_positions
            if docs is not None:  # stream positions: the same differences inside a document, no restarts (xpos.py)
                decay_k = torch.arange(key_positions.shape[1], device=positions.device,
                                       dtype=torch.float64).expand_as(key_positions)
                decay_q = decay_k[:, -queries.shape[1]:] if shard.size == 1 else decay_k[
                    :, local_queries(shard, decay_k.shape[1])]
            ctx.xpos = XposDecay(zeta, cfg.xpos_scale_base, decay_q, decay_k)
        if self.kind == "alibi":
            dist = queries[:, :, None] - key_positions[:, None, :]  # (B, T, S)
            dist = dist.clamp(min=0) if cfg.causal else dist.abs()
            slopes = alibi_slopes(cfg.n_heads).to(positions.device)  # recomputed: a few floats, no buffer to init
            slopes = ctx.own_heads(slopes[None])[0]  # this rank's H/N heads
            ctx.bias = (-slopes[None, :, None, None] * dist[:, None]).to(dtype)  # (B, H, T, S)
        if self.kind == "fire" and cfg.fire_shared:
            ctx.bias = ctx.own_heads(self.fire(queries, key_positions)).to(dtype)
        return ctx

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, ctx: PositionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (B, H, T, D) and k (B, Hkv, T, D) for rope/randpe/xpos (xPos's decay comes later, inside
        attention); identity for the rest."""
        if ctx.resample_randpe:  # this layer's own draw replaces arange(T) in the (offset) positions
            # Drawn for the whole sequence (no cache here, so key_positions are it), once per shard's group.
            t = ctx.key_positions.shape[1]
            if ctx.docs is None:
                draw = draw_positions(t, self._randpe_limit, q.device)
                plain = torch.arange(t, device=q.device, dtype=torch.float64)
            else:  # one draw per document, replacing its restarting positions
                draw = draw_document_positions(ctx.docs.k_ids, self._randpe_limit)
                plain = document_positions(ctx.docs.k_ids)
            positions = (ctx.key_positions + (ctx.shard.same(draw) - plain))[:, local_tokens(ctx.shard, t)]
            cos, sin = rope_angles(positions, ctx.inv_freq)
            cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)  # (B, 1, T, F)
            return rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        if ctx.cos is None:
            return q, k
        return rotate_pairs(q, ctx.cos, ctx.sin), rotate_pairs(k, ctx.cos, ctx.sin)
