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
tapetrain.kernels.flash4). "auto" picks the fastest one that supports the call.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tapetrain.model import kernel_record
from tapetrain.model.compile_constant import constant_to_compile
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
    from tapetrain.model import flex

    if flex.compile_failed:  # no compiler here: SDPA's boolean mask beats the unfused FlexAttention
        return sdpa_attention(q, k, v, e, causal=causal, scale=scale, docs=docs)
    try:
        return flex.flex_document_attention(q, k, v, e, causal=causal, scale=scale, docs=docs)
    except flex.CompileError as err:
        flex.compile_failed = True
        log.warning("FlexAttention could not be compiled (%s); attention with the document mask uses sdpa", err)
        return sdpa_attention(q, k, v, e, causal=causal, scale=scale, docs=docs)


def _fa4(strategy: str) -> AttentionFn:
    """A flash-attn-4 backend carrying E by `strategy` (tapetrain.kernels.flash4)."""

    def run(q, k, v, e=None, *, causal=True, scale=None, bias=None, docs=None):
        if bias is not None:
            raise ValueError("the flash-attn-4 backends take no additive bias (alibi/fire); set "
                             "model.attn_backend=sdpa")
        from tapetrain.kernels.flash4 import fa4_tape_attention  # lazy: flash-attn-4 is optional

        return fa4_tape_attention(q, k, v, e, causal=causal, scale=scale, docs=docs, strategy=strategy)

    return run


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
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTN_BACKENDS)}")


_logged_choices: set[tuple] = set()


def _cudnn_sdpa(device: torch.device) -> bool:
    """SDPA runs cuDNN's fused attention here (Hopper or newer, enabled): it takes value widths other than the
    key width at full speed, which TAPE's [V ‖ E] needs. Elsewhere SDPA would fall back to a slower kernel."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def gpu_path(backend: str, device: torch.device, dtype: torch.dtype, *, has_e: bool, has_docs: bool = False,
             gqa: bool = False) -> kernel_record.KernelKey:
    """The kernel-record key of one attention call on a CUDA device."""
    return kernel_record.KernelKey("attention", backend, kernel_record.capability_of(device),
                                  kernel_record.dtype_name(dtype), e=has_e, docs=has_docs, gqa=gqa)


@constant_to_compile
def _verified_here(name: str, device: torch.device, dtype: torch.dtype, has_e: bool, has_docs: bool,
                   gqa: bool) -> bool:
    """Installed, and (on CUDA) passed its gpu-marked tests on this GPU capability (tapetrain.model.kernel_record):
    what `auto` needs before it picks a fused backend. A constant to torch.compile: `auto` is first resolved inside
    a compiled layer, where reading the record (a file) cannot be traced."""
    if not backend_available(name, device):
        return False
    return device.type != "cuda" or kernel_record.is_verified(gpu_path(name, device, dtype, has_e=has_e,
                                                                         has_docs=has_docs, gqa=gqa))


def choose_backend(requested: str, *, device: torch.device, dtype: torch.dtype, has_bias: bool, has_e: bool,
                   has_docs: bool = False, grad: bool = True, gqa: bool = False) -> str:
    """Resolve "auto" (or validate an explicit choice) for one call site; logs each new decision once. On CUDA,
    "auto" picks a fused backend only where the kernel record says it passed on this GPU capability."""
    if requested not in ATTN_BACKENDS:
        raise ValueError(f"model.attn_backend={requested!r} is not a backend; choose one of {', '.join(ATTN_BACKENDS)}")
    if requested == "auto" and has_docs:
        choice = _document_backend(device, dtype, has_bias, has_e, grad, gqa)
    elif requested == "auto":
        if device.type == "cuda" and not has_bias and dtype in (torch.float16, torch.bfloat16):
            if has_e and _cudnn_sdpa(device):
                # Measured on H100 (docs/benchmarks/gpu): cuDNN's attention with [V ‖ E] as 2D-wide values beats
                # the Triton kernel forward+backward at every length, and the whole training step with it.
                choice = "sdpa"
            elif has_e and _verified_here("triton", device, dtype, has_e, False, gqa):
                choice = "triton"
            elif not has_e and _verified_here("flash", device, dtype, has_e, False, gqa):
                choice = "flash"
            else:
                choice = "sdpa"
        else:
            choice = "sdpa"
    else:
        if not backend_available(requested, device):
            raise RuntimeError(
                f"attention backend {requested!r} is not available on {device.type} with the installed packages; "
                "set model.attn_backend=auto (or sdpa)"
            )
        if requested in ("triton", "flash", "flex") and has_bias:
            raise ValueError(
                f"attention backend {requested!r} does not take an additive bias (alibi/fire); use sdpa or eager"
            )
        if requested == "flex" and has_docs and grad and device.type == "cpu":
            raise RuntimeError("attention backend 'flex' has no backward on CPU (torch's FlexAttention); set "
                               "model.attn_backend=auto (SDPA trains on CPU)")
        if requested == "flex" and not has_docs:
            choice = "sdpa"  # FlexAttention is here for document masks only; plain causal attention is SDPA's
        else:
            choice = requested
        if device.type == "cuda" and not torch.compiler.is_compiling():
            kernel_record.warn_if_unverified(gpu_path(choice, device, dtype, has_e=has_e, has_docs=has_docs, gqa=gqa))
    # One line per distinct choice: a TAPE model's last layer (no state update, so no E) usually gets the same
    # backend as its other layers and is not logged again.
    key = (requested, choice, device.type, dtype, has_bias, has_docs, grad if has_docs else True)
    if key not in _logged_choices and not torch.compiler.is_compiling():  # logging would break a compiled graph
        _logged_choices.add(key)
        log.info(
            "attention backend: requested=%s -> %s (device=%s dtype=%s bias=%s%s)",
            requested,
            choice,
            device.type,
            dtype,
            has_bias,
            ", for layers that carry TAPE's state E as extra values" if has_e else "",
        )
        if has_docs:
            log.info("attention backend with the document mask (data.document_mask): %s", choice)
    return choice


def _document_backend(device: torch.device, dtype: torch.dtype, has_bias: bool, has_e: bool, grad: bool,
                      gqa: bool = False) -> str:
    """"auto" with a document mask. GPU, 16-bit, no bias: the Triton kernel for TAPE's [V ‖ E] (it skips the key
    tiles of other documents), flash-attn's varlen call without E, else FlexAttention. CPU, no bias: compiled
    FlexAttention for forwards without gradients (measured 2-4.5x faster than SDPA's boolean mask, forward,
    T = 1024..4096; docs/document-masking.md) and SDPA to train (FlexAttention has no CPU backward)."""
    if has_bias or not backend_available("flex", device):
        return "sdpa"
    if device.type == "cuda":
        half = dtype in (torch.float16, torch.bfloat16)
        if half and has_e and _verified_here("triton", device, dtype, has_e, True, gqa):
            return "triton"
        if half and not has_e and _verified_here("flash", device, dtype, has_e, True, gqa):
            return "flash"
        # FlexAttention compiles its own kernel: like the others, only once verified here; SDPA's boolean mask is
        # the fallback (slower, PyTorch's own).
        return "flex" if _verified_here("flex", device, dtype, has_e, True, gqa) else "sdpa"
    return "sdpa" if grad else "flex"


def shifted_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, backend: str = "auto", scale: float | None = None
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
    backend: str = "auto",
    decay: XposDecay | None = None,
    docs: DocumentMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dispatch to a backend. Returns (A·V, A·E or None); see the module docstring for shapes. `decay`: xPos,
    applied query block by block (tapetrain.model.xpos) around this same dispatch. `docs`: the document mask."""
    if decay is not None:
        def attend(*args, **kwargs):
            return attention(*args, scale=scale, backend=backend, **kwargs)

        return decayed_attention(q, k, v, e, decay, attend, causal=causal, bias=bias, docs=docs)
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, e, bias))
    gqa = len({q.shape[1], k.shape[1], v.shape[1]}) > 1  # fewer key or value heads than query heads
    name = choose_backend(backend, device=q.device, dtype=q.dtype, has_bias=bias is not None, has_e=e is not None,
                          has_docs=docs is not None, grad=grad, gqa=gqa)
    if docs is None:  # today's calls, unchanged
        return _IMPLS[name](q, k, v, e, causal=causal, scale=scale, bias=bias)
    return _IMPLS[name](q, k, v, e, causal=causal, scale=scale, bias=bias, docs=docs)
