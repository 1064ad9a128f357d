"""TAPE attention on flash-attn-4 (`flash_attn.cute`, CuTe DSL, compiled at the first call of each shape): every
exact way to attend with values [V ‖ E] through it, as torch custom ops (no graph break under torch.compile).

flash-attn-4's calls (the contract this module relies on, read from its 4.0.0b36 source, flash_attn/cute/interface.py):
  fwd(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, return_lse=True) -> (out, lse)
      q (B, T, H, D), k (B, S, Hk, D), v (B, S, Hk, Dv) token-major (or packed (N, ·, ·) with int32 cu_seqlens of
      the sequences); H a multiple of Hk (GQA); out (B, T, H, Dv); lse (B, H, T) (packed: (H, N)) float32, the
      natural log of each query's softmax denominator. Causal is bottom-right aligned per sequence. fp16/bf16 only.
      sm90: D and Dv each 8..256 (they may differ); sm100: both ≤ 128, or (256, 256); sm80: forward only.
  bwd(q, k, v, out, dout, lse, ...) -> (dq, dk, dv): from the forward's lse (P is recomputed from it, not from a new
      softmax); sm90's backward asserts D == Dv under GQA.
Those two functions are reached through `Fa4Calls`; tests substitute a plain-torch reference of the same contract
(tests/unit/fa4_contract.py), which checks the adapters here and verifies nothing about the kernel.

Strategies for E (values V (B, Hv, S, D) and TAPE's state E (B, H, S, D) sharing one softmax):
  "two_calls" (backend "fa4"):     two (D, D) calls, V and E, each with its own exact backward.
  "wide"      (backend "fa4_wide"):     one call with values [V ‖ E] (Dv = 2D), forward and backward.
  "wide_fwd"  (backend "fa4_wide_fwd"): that one forward; the backward as two (D, D) calls on the V and E columns,
      both from the forward's lse. Exact: dS = P∘(dP − rowsum(dO∘O)) is linear in the value columns, so the two
      calls' dq and dk add up to the wide one's.
  "padded"    (backend "fa4_padded"):   q, k zero-padded to 2D and one (2D, 2D) call; the zero columns add nothing
      to QKᵀ and the scale stays 1/sqrt(D) of the real width.
Without E every backend here runs one (D, D) call: the fastest path for RoPE, NoPE and xPos layers too.

Packed documents: the per-token document ids become cu_seqlens inside the op (kernels.flash.cu_seqlens), so the
host-side lengths never reach a compiled graph.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from tapetrain.kernels.flash import cu_seqlens

STRATEGIES = ("two_calls", "wide", "wide_fwd", "padded")  # how E is carried (backend names: model.attention)
CACHE_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"  # "1": compiled kernels are kept on disk across processes


@dataclass(frozen=True)
class Packing:
    """Where packed documents put the sequences: cu_seqlens (N + 1,) int32 and the longest run, queries and keys."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


class Fa4Calls(Protocol):
    """flash-attn-4's forward and backward (see the module docstring for the shapes). `packing` None: dense
    (B, T, H, ·) tensors; else packed (N, H, ·) with its cu_seqlens."""

    def fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
            packing: Packing | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def bwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
            lse: torch.Tensor, *, scale: float, causal: bool,
            packing: Packing | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class FlashAttn4:
    """The installed flash-attn-4 (imported at the first call: importing tapetrain must not load CuTe DSL)."""

    def _interface(self):
        try:
            from flash_attn.cute import interface
        except ImportError as err:
            raise ImportError(
                "flash-attn-4 is not installed; pip install 'tapetrain[gpu]' (or the wheels of `make gpu-wheels`) "
                "or set model.attn_backend=auto"
            ) from err
        return interface

    @staticmethod
    def _lengths(packing: Packing | None) -> dict:
        if packing is None:
            return {}
        return {"cu_seqlens_q": packing.cu_q, "cu_seqlens_k": packing.cu_k, "max_seqlen_q": packing.max_q,
                "max_seqlen_k": packing.max_k}

    def fwd(self, q, k, v, *, scale, causal, packing):
        out, lse, *_ = self._interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=causal,
                                                         return_lse=True, **self._lengths(packing))
        return out, lse

    def bwd(self, q, k, v, out, dout, lse, *, scale, causal, packing):
        dq, dk, dv, *_ = self._interface()._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale,
                                                           causal=causal, **self._lengths(packing))
        return dq, dk, dv


_calls: Fa4Calls = FlashAttn4()


@contextmanager
def using_calls(calls: Fa4Calls) -> Iterator[None]:
    """Run the ops on other calls of the same contract (the CPU tests' plain-torch reference)."""
    global _calls
    saved, _calls = _calls, calls
    try:
        yield
    finally:
        _calls = saved


# ---- layouts: dense (B, T, H, ·) <-> packed (B·T, H, ·); lse (B, H, T) <-> (H, B·T)


def _packing(q_ids: torch.Tensor | None, k_ids: torch.Tensor | None) -> Packing | None:
    if q_ids is None or k_ids is None:
        return None
    return Packing(*cu_seqlens(q_ids, k_ids))


def _pack(x: torch.Tensor, packing: Packing | None) -> torch.Tensor:
    x = x.contiguous()
    return x if packing is None else x.reshape(-1, *x.shape[2:])  # (B, T, H, D) -> (B·T, H, D): rows in order


def _unpack(x: torch.Tensor, like: torch.Tensor, packing: Packing | None) -> torch.Tensor:
    return x if packing is None else x.view(*like.shape[:2], *x.shape[1:])


def _pack_lse(lse: torch.Tensor, packing: Packing | None) -> torch.Tensor:
    return lse.contiguous() if packing is None else lse.transpose(0, 1).reshape(lse.shape[1], -1).contiguous()


def _unpack_lse(lse: torch.Tensor, batch: int, packing: Packing | None) -> torch.Tensor:
    return lse if packing is None else lse.view(lse.shape[0], batch, -1).transpose(0, 1).contiguous()


# ---- the custom ops: token-major (B, T, H, ·) tensors, document ids or None


@torch.library.custom_op("tapetrain::fa4_fwd", mutates_args=())
def fa4_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_ids: torch.Tensor | None,
            k_ids: torch.Tensor | None, scale: float, causal: bool,
            bwd_split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ · scale) v: q (B, T, H, D), k (B, S, Hk, D), v (B, S, Hk, Dv) -> out (B, T, H, Dv), lse (B, H, T)
    float32. `bwd_split` > 0: the backward runs as two calls, on value columns [:bwd_split] and [bwd_split:]."""
    packing = _packing(q_ids, k_ids)
    out, lse = _calls.fwd(_pack(q, packing), _pack(k, packing), _pack(v, packing), scale=scale, causal=causal,
                          packing=packing)
    return _unpack(out, q, packing).contiguous(), _unpack_lse(lse, q.shape[0], packing).contiguous()


@fa4_fwd.register_fake
def _(q, k, v, q_ids, k_ids, scale, causal, bwd_split):
    b, t, h = q.shape[:3]
    return q.new_empty(b, t, h, v.shape[-1]), q.new_empty(b, h, t, dtype=torch.float32)


@torch.library.custom_op("tapetrain::fa4_bwd", mutates_args=())
def fa4_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, q_ids: torch.Tensor | None, k_ids: torch.Tensor | None, scale: float, causal: bool,
            bwd_split: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of fa4_fwd from its out and lse; with `bwd_split`, as two calls on the value columns."""
    packing = _packing(q_ids, k_ids)
    qp, kp, lp = _pack(q, packing), _pack(k, packing), _pack_lse(lse, packing)
    splits = [slice(0, v.shape[-1])] if bwd_split <= 0 else [slice(0, bwd_split), slice(bwd_split, v.shape[-1])]
    dq = dk = None
    dvs = []
    for cols in splits:  # the value columns of one call; dq and dk are linear in them
        dq_i, dk_i, dv_i = _calls.bwd(qp, kp, _pack(v[..., cols], packing), _pack(out[..., cols], packing),
                                      _pack(dout[..., cols], packing), lp, scale=scale, causal=causal,
                                      packing=packing)
        dq, dk = (dq_i, dk_i) if dq is None else (dq + dq_i, dk + dk_i)
        dvs.append(dv_i)
    dv = dvs[0] if len(dvs) == 1 else torch.cat(dvs, dim=-1)
    return tuple(_unpack(g, x, packing).contiguous() for g, x in ((dq, q), (dk, k), (dv, v)))


@fa4_bwd.register_fake
def _(dout, q, k, v, out, lse, q_ids, k_ids, scale, causal, bwd_split):
    # contiguous, as the op returns them (flash-attn-4 writes dense outputs for the dense inputs _pack gives it),
    # not empty_like: the model's q/k/v are strided views, and Inductor checks the strides a fake promises
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_ids, k_ids, scale, causal, bwd_split = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_ids, k_ids)
    ctx.scale, ctx.causal, ctx.bwd_split = scale, causal, bwd_split


def _backward(ctx, dout, _dlse):  # lse is an internal output: nothing differentiates it
    q, k, v, out, lse, q_ids, k_ids = ctx.saved_tensors
    dq, dk, dv = fa4_bwd(dout.contiguous(), q, k, v, out, lse, q_ids, k_ids, ctx.scale, ctx.causal, ctx.bwd_split)
    return dq, dk, dv, None, None, None, None, None


fa4_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- the adapters: heads-first tensors as every attention backend takes them


def _expand(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, Hx, S, D) -> (B, n_heads, S, D); n_heads is a multiple of Hx."""
    g = n_heads // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _token_major(x: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """(B, H, S, D) heads-first -> (B, S, H, W) token-major (a view when x came from token-major projections),
    zero-padded to `width` columns."""
    x = x.transpose(1, 2)
    return x if width is None or x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _attend(q, k, v, *, scale: float, causal: bool, docs, bwd_split: int = 0) -> torch.Tensor:
    """One fa4_fwd call on token-major tensors -> (B, H, T, Dv) heads-first."""
    q_ids, k_ids = (docs.q_ids, docs.k_ids) if docs is not None else (None, None)
    out, _ = fa4_fwd(q, k, v, q_ids, k_ids, scale, causal, bwd_split)
    return out.transpose(1, 2)


# flash-attn-4 (4.0.0b36) sizes its sm90 backward tiles by the query head dim alone: with values twice as wide as
# the keys the kernel asks for more shared memory than Hopper has (248832 > 232448 bytes at D = 64, H200,
# 2026-11-28), so CUDA refuses the launch. fa4_wide_fwd keeps the wide forward and runs the backward as two D x D calls.
WIDE_BACKWARD_ON_SM90 = ("model.attn_backend=fa4_wide cannot train on Hopper (sm90): flash-attn-4's sm90 backward "
                         "does not fit values twice as wide as the keys in shared memory; use fa4_wide_fwd (the same "
                         "wide forward, a D x D backward) or auto")


def _capability(device: torch.device) -> int | None:
    """The CUDA compute capability's major number of `device` (None off CUDA)."""
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None


def fa4_tape_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    docs=None,
    strategy: str = "two_calls",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(A·V (B, H, T, Dv), A·E (B, H, T, De) or None) on flash-attn-4; q (B, H, T, D), k (B, Hk, S, D),
    v (B, Hv, S, Dv), e (B, H, S, De) heads-first; docs a DocumentMask or None; `strategy` one of STRATEGIES."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"flash-attn-4 needs fp16/bf16 inputs, got {q.dtype}; set model.attn_backend=sdpa")
    if strategy == "wide" and e is not None and torch.is_grad_enabled() and _capability(q.device) == 9:
        if any(x.requires_grad for x in (q, k, v, e)):
            raise ValueError(WIDE_BACKWARD_ON_SM90)
    n_heads, d = q.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    run = {"scale": scale, "causal": causal, "docs": docs}
    hk, hv = k.shape[1], v.shape[1]
    if hk != hv:  # flash-attn-4 takes one kv head count; lcm(Hk, Hv) divides H and keeps the head maps
        n_kv = math.lcm(hk, hv)
        k, v = _expand(k, n_kv), _expand(v, n_kv)
    q_t = _token_major(q)
    if e is None:
        return _attend(q_t, _token_major(k), _token_major(v), **run), None
    k_full = _expand(k, n_heads)  # e has one head per query head, so every call with E needs H key heads
    if strategy == "two_calls":
        return (_attend(q_t, _token_major(k), _token_major(v), **run),
                _attend(q_t, _token_major(k_full), _token_major(e), **run))
    dv = v.shape[-1]
    values = torch.cat([_token_major(_expand(v, n_heads)), _token_major(e)], dim=-1)  # (B, S, H, Dv + De)
    if strategy == "padded":
        width = max(d, values.shape[-1])
        out = _attend(_token_major(q, width), _token_major(k_full, width), F.pad(values, (0, width - values.shape[-1])),
                      **run)[..., : values.shape[-1]]
    else:
        out = _attend(q_t, _token_major(k_full), values, bwd_split=dv if strategy == "wide_fwd" else 0, **run)
    return out[..., :dv], out[..., dv:]
