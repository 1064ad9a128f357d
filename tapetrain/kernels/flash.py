"""TAPE attention on flash-attn (GPU, fp16/bf16): A·V and A·E via flash_attn_func.

flash-attn 2 needs one head dim for q, k and v, so the positional stream E (extra value columns) is handled by
one of two exact strategies:

  * "two_calls": flash(q, k, v) and flash(q, k, e). Each is an exact autograd op; the softmax (and in the
    backward the recomputation of P) is done twice.
  * "padded":    one flash call with q, k zero-padded to width W = max(D, Dv + De) and values [v ‖ e] (padded to
    W). Zero columns add nothing to QK^T so the logits are unchanged; softmax_scale = 1/sqrt(D) (the real D)
    is passed explicitly. Costs a wider QK^T (W instead of D) and a concatenation.

"auto" uses two_calls. flash-attn 2 has not run on any GPU of the project's campaigns (the package index carries
only its source, a CUDA build of hours): neither strategy is measured or verified there; `tools/benchmark.py
attention --backends flash` measures both where it is installed (A100 users). flash-attn-4, its successor, is
tapetrain.kernels.flash4.

Shapes are heads-first as every attention backend takes them (q (B, H, T, D), k (B, Hk, S, D), v (B, Hv, S, Dv),
e (B, H, S, De): the heads-first view of TAPE's token-major E (B, S, M, De)); flash-attn wants (B, T, H, D), so
tensors are transposed on the way in and out. Causal masking in flash-attn >= 2.1 is bottom-right aligned,
matching tapetrain. flash-attn does GQA natively when k and v share a head count; when Hk != Hv both are expanded
to lcm(Hk, Hv) heads (repeat_interleave; a no-op for TAPE's keys, which already have H heads).

Packed documents (docs, a tapetrain.model.documents.DocumentMask): every (row, document) becomes one sequence of
flash_attn_varlen_func, with cu_seqlens built from the ids; causal alignment is bottom-right per sequence, which
is what a query block of xPos (queries [first, stop) against keys [:stop]) needs too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

STRATEGIES = ("auto", "two_calls", "padded")


NOT_INSTALLED = ("flash-attn is not installed (flash-attn 2: pip install flash-attn --no-build-isolation builds "
                 "it; the gpu extra installs flash-attn-4, backend fa4); set model.attn_backend=auto")


def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func
    except ImportError as err:
        raise ImportError(NOT_INSTALLED) from err
    return flash_attn_func


def _expand(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, Hx, S, D) -> (B, n_heads, S, D); n_heads is a multiple of Hx."""
    g = n_heads // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _pad_last(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _flash(q, k, v, *, causal: bool, scale: float, docs=None) -> torch.Tensor:
    """flash_attn_func on heads-first tensors; pads q/k or v so the head dims agree. Returns (B, H, T, Dv)."""
    if docs is not None:
        return _flash_varlen(q, k, v, causal=causal, scale=scale, docs=docs)
    fn = _flash_attn_func()
    dv = v.shape[-1]
    width = max(q.shape[-1], dv)
    q, k, v = (_pad_last(x, width).transpose(1, 2) for x in (q, k, v))  # (B, T|S, heads, W)
    out = fn(q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal)  # (B, T, H, W)
    return out[..., :dv].transpose(1, 2)


def cu_seqlens(q_ids: torch.Tensor, k_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Document ids (B, T) of queries and (B, S) of keys -> (cu_seqlens_q, cu_seqlens_k) int32 (N + 1,) over the N
    (row, document) pairs that have keys, in order, and the longest query and key run. A document may have no
    queries (an earlier document of an xPos query block): its query length is 0."""
    b = q_ids.shape[0]
    base = int(k_ids.min())
    span = int(k_ids.max()) - base + 1
    rows = torch.arange(b, device=q_ids.device)[:, None] * span
    n = b * span
    count_q = torch.bincount((q_ids.long() - base + rows).flatten(), minlength=n)
    count_k = torch.bincount((k_ids.long() - base + rows).flatten(), minlength=n)
    keep = count_k > 0
    count_q, count_k = count_q[keep], count_k[keep]
    zero = count_q.new_zeros(1)
    cu_q = torch.cat([zero, count_q.cumsum(0)]).to(torch.int32)
    cu_k = torch.cat([zero, count_k.cumsum(0)]).to(torch.int32)
    return cu_q, cu_k, int(count_q.max()), int(count_k.max())


def _flash_varlen(q, k, v, *, causal: bool, scale: float, docs) -> torch.Tensor:
    """flash_attn_varlen_func over (row, document) sequences; shapes as `_flash`."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as err:
        raise ImportError(NOT_INSTALLED) from err
    b, h, t, _ = q.shape
    dv = v.shape[-1]
    width = max(q.shape[-1], dv)
    cu_q, cu_k, max_q, max_k = cu_seqlens(docs.q_ids, docs.k_ids)
    # (B, H, T, ·) -> token-major packed (B·T, H, W): rows are concatenated, documents are contiguous within them
    q, k, v = (_pad_last(x, width).transpose(1, 2).reshape(-1, x.shape[1], width) for x in (q, k, v))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale,
                                 causal=causal)  # (B·T, H, W)
    return out.view(b, t, h, width)[..., :dv].transpose(1, 2)


def flash_tape_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    strategy: str = "auto",
    docs=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (A·V (B, H, T, Dv), A·E (B, H, T, De) or None) using flash-attn; see the module docstring.
    docs: a DocumentMask (packed documents) or None."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"flash-attn needs fp16/bf16 inputs, got {q.dtype}; use the sdpa or triton backend")
    n_heads = q.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    hk, hv = k.shape[1], v.shape[1]
    if hk != hv:  # flash-attn's GQA needs one kv head count; lcm(Hk, Hv) divides H and keeps h -> head maps
        n_kv = math.lcm(hk, hv)
        k, v = _expand(k, n_kv), _expand(v, n_kv)
    if e is None:
        return _flash(q, k, v, causal=causal, scale=scale, docs=docs), None

    k_full = _expand(k, n_heads)  # e has one head per query head, so its call needs H key heads
    if strategy in ("auto", "two_calls"):
        o = _flash(q, k, v, causal=causal, scale=scale, docs=docs)
        o_e = _flash(q, k_full, e, causal=causal, scale=scale, docs=docs)
        return o, o_e

    dv, de = v.shape[-1], e.shape[-1]
    width = max(q.shape[-1], dv + de)
    values = _pad_last(torch.cat([_expand(v, n_heads), e], dim=-1), width)  # (B, H, S, W)
    out = _flash(_pad_last(q, width), _pad_last(k_full, width), values, causal=causal, scale=scale, docs=docs)
    return out[..., :dv], out[..., dv : dv + de]
