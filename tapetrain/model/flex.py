"""FlexAttention (torch.nn.attention.flex_attention) with a document BlockMask: the "flex" attention backend.

Values may be wider than q/k, so TAPE's [V ‖ E] (B, H, S, Dv + De) goes through one softmax, as with SDPA. The
BlockMask marks (128 × 128) tiles with no same-document, causal pair as empty; compiled, flex skips them. No
additive bias (ALiBi/FIRE go to SDPA). Compiled once per process (torch.compile of flex_attention, no recompile
for new document layouts of one shape). On CPU (torch 2.13) FlexAttention has no backward: there it serves
forwards without gradients (evaluation), where it measured 2-4.5x faster than SDPA's boolean mask
(tools/bench_document_mask.py, docs/document-masking.md); training on CPU uses SDPA.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from tapetrain.model.documents import DocumentMask

log = logging.getLogger(__name__)


def flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


class CompileError(RuntimeError):
    """torch.compile of flex_attention failed (e.g. no C++ compiler for CPU code)."""


def _compile_failures() -> tuple[type[BaseException], ...]:
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    return BackendCompilerFailed, InductorError


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def document_block_mask(docs: DocumentMask, causal: bool, block: int = 128, offset: int | None = None):
    """A BlockMask of (B, 1, T, S): same document and (if causal) key <= query + offset, offset = S − T by default
    (bottom-right aligned); built once per DocumentMask (every layer of a forward shares it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    q_ids, k_ids = docs.q_ids, docs.k_ids
    t, s = q_ids.shape[1], k_ids.shape[1]
    off = s - t if offset is None else offset
    key = ("flex", causal, block, off)
    if key in docs.cache:
        return docs.cache[key]

    def mask_mod(b, h, q_idx, kv_idx):
        same = q_ids[b, q_idx] == k_ids[b, kv_idx]
        return same & (kv_idx <= q_idx + off) if causal else same

    docs.cache[key] = create_block_mask(mask_mod, q_ids.shape[0], None, t, s, device=q_ids.device, BLOCK_SIZE=block)
    return docs.cache[key]


def flex_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    docs: DocumentMask | None = None,
    compiled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B, H, T, D), k (B, Hk, S, D), v (B, Hv, S, Dv), e (B, H, S, De) or None -> (A·V, A·E or None)."""
    from torch.nn.attention.flex_attention import flex_attention

    if docs is None:
        raise ValueError("the flex backend serves document masks; without one use sdpa")
    n_heads = q.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    dv = v.shape[-1]
    if e is not None:  # E has a head per query head: expand k/v to H heads and widen the values to [V ‖ E]
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1) if k.shape[1] != n_heads else k
        v = v.repeat_interleave(n_heads // v.shape[1], dim=1) if v.shape[1] != n_heads else v
        v = torch.cat([v, e], dim=-1)
    elif k.shape[1] != v.shape[1]:
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
        v = v.repeat_interleave(n_heads // v.shape[1], dim=1)
    t, offset = q.shape[2], k.shape[2] - q.shape[2]  # the causal alignment of the unpadded shapes
    if compiled and q.device.type == "cpu":
        q, k, v, docs = _pad_to_block_grid(q, k, v, docs)
    mask = document_block_mask(docs, causal, offset=offset)
    gqa = k.shape[1] != n_heads
    if compiled and not torch.compiler.is_compiling():
        failures = _compile_failures()
        try:
            out = _compiled()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
        except failures as err:
            raise CompileError(str(err).splitlines()[0] if str(err) else type(err).__name__) from err
    else:
        out = flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    out = out[:, :, :t]  # drop the grid padding's query rows
    if e is None:
        return out, None
    return out[..., :dv], out[..., dv:]


_compile_failed = False  # once torch.compile of flex_attention failed in this process, never tried again


def flex_document_attention_or(fallback, q, k, v, e=None, *, causal=True, scale=None, docs=None):
    """flex_document_attention, or `fallback` (same arguments) where FlexAttention cannot be compiled here (e.g. no
    C++ compiler for CPU code): the unfused FlexAttention would be slower than the fallback's boolean mask."""
    global _compile_failed
    if not _compile_failed:
        try:
            return flex_document_attention(q, k, v, e, causal=causal, scale=scale, docs=docs)
        except CompileError as err:
            _compile_failed = True
            log.warning("FlexAttention could not be compiled (%s); attention with the document mask uses sdpa", err)
    return fallback(q, k, v, e, causal=causal, scale=scale, docs=docs)


BLOCK = 128


def _pad_to_block_grid(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: DocumentMask
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DocumentMask]:
    """Pad T and S up to multiples of the 128-token block. Compiled flex on CPU (torch 2.13) gave wrong rows, even
    NaN, for lengths off that grid on some CPUs. Padded queries get document id -1 and padded keys -2, so no pair
    with padding is ever unmasked; both are appended at the end (the caller keeps the unpadded S − T alignment)."""
    t, s = q.shape[2], k.shape[2]
    pad_t, pad_s = -t % BLOCK, -s % BLOCK
    if pad_t == 0 and pad_s == 0:
        return q, k, v, docs
    key = ("flex-padded", pad_t, pad_s)
    if key not in docs.cache:  # one padded mask per DocumentMask, so every layer shares its BlockMask
        pad = torch.nn.functional.pad
        docs.cache[key] = DocumentMask(pad(docs.q_ids, (0, pad_t), value=-1), pad(docs.k_ids, (0, pad_s), value=-2))

    def grow(x: torch.Tensor, n: int) -> torch.Tensor:  # (B, H, L, D) -> (B, H, L + n, D), zeros appended
        return torch.nn.functional.pad(x, (0, 0, 0, n))

    return grow(q, pad_t), grow(k, pad_s), grow(v, pad_s), docs.cache[key]
