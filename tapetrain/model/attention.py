"""Attention backends behind one interface.

Every backend computes, per query head h,

    A = softmax(q_h k_h^T * scale + bias_h + causal mask)     (T × S)
    o = A · v_h                                                (T × Dv)
    o_e = A · e_h          (only when e is given; TAPE's positional stream)

from a single softmax. TAPE treats its positional state E as extra value channels, so A·V and A·E share one
pass (README.md "TAPE as implemented").

Shapes (heads-first, like SDPA):
    q   (B, H,  T, D)
    k   (B, Hk, S, D)     Hk divides H (grouped-query attention)
    v   (B, Hv, S, Dv)    Hv divides H (for TAPE keys are per query head but values stay per kv head)
    e   (B, H,  S, De) or None: TAPE's token-major state E (B, S, M, De), M = H, seen heads-first through
        E.transpose(1, 2) (a view, no copy; the same holds for q, k, v, which the projections give token-major)
    bias (1|B, H, T, S) additive float bias or None (ALiBi, FIRE)

Causal masking is aligned bottom-right: query t (of T) sits at absolute position S - T + t, so the same call works
for a full forward (T == S) and for incremental decoding with a KV cache (T < S).

docs (tapetrain.model.documents.DocumentMask, or None): packed documents; a query then sees only the keys of its
own document (causal within it). Every backend takes it: eager/sdpa as a dense boolean mask, "flex" as a
FlexAttention BlockMask, triton as per-token ids, flash as cu_seqlens (flash-attn's varlen call).

Backends: "eager" (the reference), "sdpa" (torch.nn.functional.scaled_dot_product_attention), "triton" (the fused
kernel in tapetrain.kernels), "flash" (flash-attn 2, GPU), "flex" (FlexAttention, for document masks), and
flash-attn-4's "fa4", "fa4_wide", "fa4_wide_fwd", "fa4_padded" (one per way of carrying E; FA4_BACKENDS,
tapetrain.kernels.flash4). Which one a layer runs is the execution plan's decision (model/execution_plan.py), made
once per process.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tapetrain.errors import ConfigError
from tapetrain.model.config import ATTN_BACKENDS
from tapetrain.model.documents import DocumentMask
from tapetrain.model.xpos import XposDecay, decayed_attention

log = logging.getLogger(__name__)

AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def expand_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, Hx, S, D) -> (B, n_heads, S, D) by repeating each head n_heads // Hx times (GQA)."""
    groups = n_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def causal_mask(t: int, s: int, device: torch.device) -> torch.Tensor:
    """Boolean (T, S) mask, True where attention is allowed; bottom-right aligned."""
    q_pos = torch.arange(s - t, s, device=device)[:, None]
    k_pos = torch.arange(s, device=device)[None, :]
    return k_pos <= q_pos


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    docs: DocumentMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference implementation: materialises A. Used for tests and as the fallback."""
    n_heads, t, d = q.shape[1], q.shape[2], q.shape[3]
    s = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = expand_heads(k, n_heads), expand_heads(v, n_heads)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias
    allowed = allowed_mask(t, s, q.device, causal, docs)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, v)
    out_e = torch.matmul(probs, e) if e is not None else None
    return out, out_e


# On CPU, SDPA's fused kernel takes values only as wide as q/k: [V ‖ E] (2D) falls back to the math path, which
# materialises the (T, S) probabilities. From this many keys on, two fused calls (V, then E: the softmax twice)
# are faster; below it one call is (docs/performance.md "TAPE attention on CPU", tools/benchmark.py attention).
CPU_TWO_CALLS_FROM_KEYS = 1024


def sdpa_value_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor | None) -> int:
    """1 ([V ‖ E] in one call) or 2 (V and E in separate calls, each on the CPU fused kernel)."""
    same_width = e is not None and v.shape[-1] == e.shape[-1] == q.shape[-1]
    return 2 if same_width and q.device.type == "cpu" and k.shape[2] >= CPU_TWO_CALLS_FROM_KEYS else 1


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    docs: DocumentMask | None = None,
    value_calls: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch SDPA. For TAPE the values are [V ‖ E] (value width Dv + De) so one softmax serves both, or, where
    that is slower (CPU, long sequences: sdpa_value_calls), V and E go through two calls; `value_calls` forces
    1 or 2 (benchmarks). Both are exact: the same softmax applied to each value channel."""
    n_heads, t = q.shape[1], q.shape[2]
    s = k.shape[2]
    k = expand_heads(k, n_heads)
    dv = v.shape[-1]
    calls = value_calls or sdpa_value_calls(q, k, v, e)
    if e is not None and calls == 1:
        values = torch.cat([expand_heads(v, n_heads), e], dim=-1)  # (B, H, S, Dv + De)
    else:
        values = expand_heads(v, n_heads)
    mask = None
    is_causal = False
    if docs is not None:  # a boolean (B, 1, T, S) mask, or the bias with -inf outside the allowed keys
        allowed = allowed_mask(t, s, q.device, causal, docs)
        mask = allowed if bias is None else bias.masked_fill(~allowed, float("-inf"))
    elif bias is not None:
        mask = bias
        if causal and t > 1:
            mask = bias.masked_fill(~causal_mask(t, s, q.device), float("-inf"))
    elif causal and t > 1:
        if t == s:
            is_causal = True
        else:
            mask = causal_mask(t, s, q.device)
    out = F.scaled_dot_product_attention(q, k, values, attn_mask=mask, is_causal=is_causal, scale=scale)
    if e is None:
        return out, None
    if calls == 2:
        return out, F.scaled_dot_product_attention(q, k, e, attn_mask=mask, is_causal=is_causal, scale=scale)
    return out[..., :dv], out[..., dv:]


def allowed_mask(t: int, s: int, device: torch.device, causal: bool,
                 docs: DocumentMask | None) -> torch.Tensor | None:
    """Boolean mask of the allowed (query, key) pairs: (T, S) causal, (B, 1, T, S) with documents; None = all."""
    mask = causal_mask(t, s, device) if causal else None
    if docs is None:
        return mask
    same = docs.same()
    return same if mask is None else same & mask


def _triton_attention(q, k, v, e=None, *, causal=True, scale=None, bias=None, docs=None):
    from tapetrain.kernels.tape_attention import tape_attention  # lazy: triton is optional

    if docs is None:
        return tape_attention(q, k, v, e, causal=causal, scale=scale)
    return tape_attention(q, k, v, e, causal=causal, scale=scale, q_doc=docs.q_ids, k_doc=docs.k_ids)


def _flash_attention(q, k, v, e=None, *, causal=True, scale=None, bias=None, docs=None):
    from tapetrain.kernels.flash import flash_tape_attention  # lazy: flash-attn is optional

    return flash_tape_attention(q, k, v, e, causal=causal, scale=scale, docs=docs)


def _flex_attention(q, k, v, e=None, *, causal=True, scale=None, bias=None, docs=None):
    from tapetrain.model.flex import flex_document_attention_or

    # where FlexAttention cannot be compiled (no C++ compiler), SDPA's boolean mask beats the unfused flex
    return flex_document_attention_or(sdpa_attention, q, k, v, e, causal=causal, scale=scale, docs=docs)


def _fa4(strategy: str) -> AttentionFn:
    """A flash-attn-4 backend carrying E by `strategy` (tapetrain.kernels.flash4)."""

    def run(q, k, v, e=None, *, causal=True, scale=None, bias=None, docs=None):
        if bias is not None:
            raise ValueError("the flash-attn-4 backends take no additive bias (alibi/fire); set "
                             "model.attn_backend=sdpa")
        from tapetrain.kernels.flash4 import fa4_tape_attention  # lazy: flash-attn-4 is optional

        return fa4_tape_attention(q, k, v, e, causal=causal, scale=scale, docs=docs, strategy=strategy)

    return run


FALLBACKS = ("eager", "sdpa")  # PyTorch's own: they take every call (bias, any dtype, document masks)
FA4_BACKENDS = {"fa4": "two_calls", "fa4_wide": "wide", "fa4_wide_fwd": "wide_fwd", "fa4_padded": "padded"}

_IMPLS: dict[str, AttentionFn] = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "triton": _triton_attention,
    "flash": _flash_attention,
    "flex": _flex_attention,
    **{name: _fa4(strategy) for name, strategy in FA4_BACKENDS.items()},
}


def _module_installed(name: str) -> bool:
    """Whether module `name` can be imported, without importing it (its parent packages are imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def backend_available(name: str, device: torch.device) -> bool:
    """Whether backend `name` can run on `device` with what is installed."""
    if name in ("eager", "sdpa"):
        return True
    if name == "flex":
        from tapetrain.model.flex import flex_available

        return flex_available()
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        import os

        return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if name == "flash":  # flash-attn 2's interface (flash-attn-4 alone makes flash_attn a namespace package)
        return device.type == "cuda" and _module_installed("flash_attn.flash_attn_interface")
    if name in FA4_BACKENDS:  # found, not imported: importing it loads CuTe DSL
        return device.type == "cuda" and _module_installed("flash_attn.cute")
    raise ConfigError(f"model.attn_backend={name!r} is not a backend; choose one of {', '.join(ATTN_BACKENDS)}")


def shifted_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, backend: str = "sdpa", scale: float | None = None
) -> torch.Tensor:
    """LongLoRA's S²-Attn (training only): causal attention inside groups of `group` tokens; the second half of
    the heads works on the sequence rolled by group/2, so information crosses group borders.

    q (B, H, T, D), k/v (B, Hk|Hv, T, D) with T divisible by `group`; `scale` as `attention`; returns (B, H, T, Dv).
    """
    b, h, t, _ = q.shape
    if t % group or group % 2:
        raise ValueError(
            f"shifted sparse attention needs the sequence length ({t}) to be a multiple of an even group size "
            f"({group}); set model.s2_attn_group_fraction so that seq_len × fraction is such a divisor"
        )
    k, v = expand_heads(k, h), expand_heads(v, h)
    half, shift = h // 2, group // 2

    def roll(x: torch.Tensor, by: int) -> torch.Tensor:  # roll only the second half of the heads
        return torch.cat([x[:, :half], x[:, half:].roll(by, dims=2)], dim=1)

    def grouped(x: torch.Tensor) -> torch.Tensor:  # (B, H, T, D) -> (B·T/G, H, G, D)
        return x.reshape(b, h, t // group, group, -1).transpose(1, 2).reshape(b * (t // group), h, group, -1)

    q, k, v = (grouped(roll(x, -shift)) for x in (q, k, v))  # no document mask: refused with one (transformer.py)
    out, _ = attention(q, k, v, causal=True, scale=scale, backend=backend)
    out = out.reshape(b, t // group, h, group, -1).transpose(1, 2).reshape(b, h, t, -1)
    return roll(out, shift)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    backend: str = "sdpa",
    decay: XposDecay | None = None,
    docs: DocumentMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run `backend` (a name the execution plan chose, model/execution_plan.py; "auto" is resolved there, once,
    not per call). Returns (A·V, A·E or None); see the module docstring for shapes. `decay`: xPos, applied query
    block by block (tapetrain.model.xpos) around this same dispatch. `docs`: the document mask."""
    if decay is not None:
        def attend(*args, **kwargs):
            return attention(*args, scale=scale, backend=backend, **kwargs)

        return decayed_attention(q, k, v, e, decay, attend, causal=causal, bias=bias, docs=docs)
    if backend not in _IMPLS:
        raise ValueError(f"attention backend {backend!r} is not a backend attention() runs: choose one of "
                         f"{', '.join(_IMPLS)} ('auto' is resolved once, by tapetrain.model.execution_plan)")
    if docs is None:  # today's calls, unchanged
        return _IMPLS[backend](q, k, v, e, causal=causal, scale=scale, bias=bias)
    return _IMPLS[backend](q, k, v, e, causal=causal, scale=scale, bias=bias, docs=docs)
