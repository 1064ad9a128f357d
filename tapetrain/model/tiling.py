"""Tiled MLP: the per-token MLP work of a layer over sequence chunks, recomputed in backward (`model.tiled_mlp`).

SwiGLU's intermediates, (B, T, F) three to five times over, and TAPE's MLP-side update of E, (B, T, I, D) three
times, are the largest tensors a layer saves for backward. Both are per token, so they can be computed over chunks
of the token axis: in forward each chunk runs without keeping its intermediates; in backward each chunk is run
again and differentiated before the next one is, so at most one chunk's intermediates exist at a time.

This is what DeepSpeed's ALST `TiledMLP` (deepspeed/runtime/sequence_parallel/ulysses_sp.py) does, written here
with non-reentrant `torch.utils.checkpoint` per chunk instead of a custom autograd.Function because:
  - the model stays plain PyTorch (it never imports deepspeed);
  - weight gradients flow through the one autograd graph: the engine sums every chunk's contribution before a
    weight's AccumulateGrad runs, so DeepSpeed's ZeRO-1/2 gradient hooks fire once per weight, with no
    `ds_grad_is_ready` bookkeeping, and ZeRO-3 gathers the weights in the recompute through its module hooks,
    as it does for activation checkpointing;
  - it nests inside activation checkpointing (also non-reentrant) and needs no sequence parallelism.
The autograd engine runs the ready node with the highest sequence number first, so after the concatenation's
backward it finishes the last chunk's whole subgraph (recompute and backward) before it starts the previous one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

TiledFn = Callable[..., tuple[torch.Tensor, ...]]


def tile_count(setting: int | str, tokens: int, width: int) -> int:
    """Chunks for `tokens` tokens per sequence (this rank's T/N under sequence parallelism).

    0 or 1: off; n: n chunks (at most one per token); "auto": ceil(tokens / width) with width = d_model, ALST's
    rule, so one chunk's (chunk, F) intermediate is about the size of an MLP weight. The count depends on shapes
    only, which every rank of a group shares, so ZeRO-3's gathers in the recompute stay in step across ranks."""
    if setting == "auto":
        return max(1, math.ceil(tokens / width))
    return max(1, min(int(setting), tokens))


def tiled(fn: TiledFn, inputs: tuple[torch.Tensor, ...], chunks: int) -> tuple[torch.Tensor, ...]:
    """fn over `chunks` slices of dim 1 (tokens) of every input, outputs concatenated on dim 1.

    inputs (B, T, ...) each -> fn's outputs (B, T, ...). With gradients on, each chunk is checkpointed: forward
    keeps only the chunk's inputs (views of `inputs`), backward recomputes it. fn must be per token and free of
    randomness (it is recomputed without restoring the RNG state)."""
    if chunks <= 1:
        return fn(*inputs)
    pieces = zip(*(x.chunk(chunks, dim=1) for x in inputs), strict=True)
    if torch.is_grad_enabled():
        outputs = [checkpoint(fn, *piece, use_reentrant=False, preserve_rng_state=False) for piece in pieces]
    else:  # no backward: chunking still bounds the forward's transient (B, T/n, F)
        outputs = [fn(*piece) for piece in pieces]
    return tuple(torch.cat(parts, dim=1) for parts in zip(*outputs, strict=True))
