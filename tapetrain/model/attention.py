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
    e   (B, H,  S, De) or None
    bias (1|B, H, T, S) additive float bias or None (ALiBi, FIRE)

Causal masking is aligned bottom-right: query t (of T) sits at absolute position S - T + t, so the same call works
for a full forward (T == S) and for incremental decoding with a KV cache (T < S).

Backends: "eager" (the reference), "sdpa" (torch.nn.functional.scaled_dot_product_attention), "triton" (the fused
kernel in tapetrain.kernels), "flash" (flash-attn, GPU). "auto" picks the fastest one that supports the call.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tapetrain.model.config import ATTN_BACKENDS
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference implementation: materialises A. Used for tests and as the fallback."""
    n_heads, t, d = q.shape[1], q.shape[2], q.shape[3]
    s = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k, v = expand_heads(k, n_heads), expand_heads(v, n_heads)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias
    if causal:
        scores = scores.masked_fill(~causal_mask(t, s, q.device), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs, v)
    out_e = torch.matmul(probs, e) if e is not None else None
    return out, out_e


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch SDPA. For TAPE the values are [V ‖ E] (value width Dv + De) so one softmax serves both."""
    n_heads, t = q.shape[1], q.shape[2]
    s = k.shape[2]
    k = expand_heads(k, n_heads)
    dv = v.shape[-1]
    if e is not None:
        values = torch.cat([expand_heads(v, n_heads), e], dim=-1)  # (B, H, S, Dv + De)
    else:
        values = expand_heads(v, n_heads)
    mask = None
    is_causal = False
    if bias is not None:
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
    return out[..., :dv], out[..., dv:]


def _triton_attention(q, k, v, e=None, *, causal=True, scale=None, bias=None):
    from tapetrain.kernels.tape_attention import tape_attention  # lazy: triton is optional

    return tape_attention(q, k, v, e, causal=causal, scale=scale)


def _flash_attention(q, k, v, e=None, *, causal=True, scale=None, bias=None):
    from tapetrain.kernels.flash import flash_tape_attention  # lazy: flash-attn is optional

    return flash_tape_attention(q, k, v, e, causal=causal, scale=scale)


_IMPLS: dict[str, AttentionFn] = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "triton": _triton_attention,
    "flash": _flash_attention,
}


def backend_available(name: str, device: torch.device) -> bool:
    """Whether backend `name` can run on `device` with what is installed."""
    if name in ("eager", "sdpa"):
        return True
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        import os

        return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if name == "flash":
        if device.type != "cuda":
            return False
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return False
        return True
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTN_BACKENDS)}")


_logged_choices: set[tuple] = set()


def _cudnn_sdpa(device: torch.device) -> bool:
    """SDPA runs cuDNN's fused attention here (Hopper or newer, enabled): it takes value widths other than the
    key width at full speed, which TAPE's [V ‖ E] needs. Elsewhere SDPA would fall back to a slower kernel."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def choose_backend(requested: str, *, device: torch.device, dtype: torch.dtype, has_bias: bool, has_e: bool) -> str:
    """Resolve "auto" (or validate an explicit choice) for one call site; logs each new decision once."""
    if requested not in ATTN_BACKENDS:
        raise ValueError(f"model.attn_backend={requested!r} is not a backend; choose one of {', '.join(ATTN_BACKENDS)}")
    if requested == "auto":
        if device.type == "cuda" and not has_bias and dtype in (torch.float16, torch.bfloat16):
            if has_e and _cudnn_sdpa(device):
                # Measured on H100 (docs/benchmarks/gpu): cuDNN's attention with [V ‖ E] as 2D-wide values beats
                # the Triton kernel forward+backward at every length, and the whole training step with it.
                choice = "sdpa"
            elif has_e and backend_available("triton", device):
                choice = "triton"
            elif not has_e and backend_available("flash", device):
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
        if requested in ("triton", "flash") and has_bias:
            raise ValueError(
                f"attention backend {requested!r} does not take an additive bias (alibi/fire); use sdpa or eager"
            )
        choice = requested
    # One line per distinct choice: a TAPE model's last layer (no state update, so no E) usually gets the same
    # backend as its other layers and is not logged again.
    key = (requested, choice, device.type, dtype, has_bias)
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
    return choice


def shifted_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int, backend: str = "auto"
) -> torch.Tensor:
    """LongLoRA's S²-Attn (training only): causal attention inside groups of `group` tokens; the second half of
    the heads works on the sequence rolled by group/2, so information crosses group borders.

    q (B, H, T, D), k/v (B, Hk|Hv, T, D) with T divisible by `group`; returns (B, H, T, Dv).
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

    q, k, v = (grouped(roll(x, -shift)) for x in (q, k, v))
    out, _ = attention(q, k, v, causal=True, backend=backend)
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dispatch to a backend. Returns (A·V, A·E or None); see the module docstring for shapes. `decay`: xPos,
    applied query block by block (tapetrain.model.xpos) around this same dispatch."""
    if decay is not None:
        def attend(*args, **kwargs):
            return attention(*args, scale=scale, backend=backend, **kwargs)

        return decayed_attention(q, k, v, e, decay, attend, causal=causal, bias=bias)
    name = choose_backend(backend, device=q.device, dtype=q.dtype, has_bias=bias is not None, has_e=e is not None)
    return _IMPLS[name](q, k, v, e, causal=causal, scale=scale, bias=bias)
