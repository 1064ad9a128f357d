"""A plain-torch REFERENCE OF THE CONTRACT of flash-attn-4's forward and backward calls (as
tapetrain.kernels.flash4 uses them): shapes, layouts, lse, varlen packing, GQA, bottom-right causal masking, and the
preconditions the kernel asserts. It lets the CPU tests check tapetrain's adapters around those calls; it is not
flash-attn-4 and verifies nothing about the kernel (the GPU tests in tests/gpu/test_gpu_flash4.py do that).

The backward follows the flash-attention algorithm from the given lse (P = exp(S·scale − lse), D = rowsum(dO∘O),
dS = P∘(dO Vᵀ − D)), as the kernel does, so a wrong lse passed by an adapter gives wrong gradients here too.
"""

from __future__ import annotations

import torch

from tapetrain.kernels.flash4 import Packing


def _sequences(x: torch.Tensor, cu: torch.Tensor | None) -> list[torch.Tensor]:
    """(B, T, H, ·) -> B tensors (T, H, ·); packed (N, H, ·) with cu (n + 1,) -> n tensors."""
    if cu is None:
        return list(x.unbind(0))
    bounds = cu.tolist()
    return [x[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _check(q, k, v, packing: Packing | None) -> None:
    """What flash-attn-4 asserts (flash_attn/cute/interface.py, sm90 limits)."""
    assert q.dtype in (torch.float16, torch.bfloat16), "inputs must be float16 or bfloat16"
    assert q.dtype == k.dtype == v.dtype
    assert all(x.stride(-1) == 1 for x in (q, k, v)), "last dim must be contiguous"
    assert k.shape[:-1] == v.shape[:-1], "k and v share their sequence and head count"
    assert q.shape[-2] % k.shape[-2] == 0, "num_head must be divisible by num_head_kv"
    for width in (q.shape[-1], v.shape[-1]):
        assert 8 <= width <= 256 and width % 8 == 0, "head dims 8..256, multiples of 8 (sm90)"
    if packing is None:
        assert q.dim() == 4 and q.shape[0] == k.shape[0]
    else:
        assert q.dim() == 3 and packing.cu_q.dtype == packing.cu_k.dtype == torch.int32
        assert packing.cu_q.shape == packing.cu_k.shape
        assert int(packing.cu_q[-1]) == q.shape[0] and int(packing.cu_k[-1]) == k.shape[0]


def _heads_first(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """(S, Hx, ·) -> (Hx·groups, S, ·) fp32, each head repeated `groups` times (GQA)."""
    return x.float().transpose(0, 1).repeat_interleave(groups, dim=0)


def _probs(q, k, scale: float, causal: bool, lse: torch.Tensor | None = None):
    """One sequence: q (T, H, D), k (S, Hk, D) -> scores (H, T, S) fp32 masked, P, lse (H, T)."""
    h, t, s = q.shape[1], q.shape[0], k.shape[0]
    kk = _heads_first(k, h // k.shape[1])
    scores = _heads_first(q) @ kk.transpose(1, 2) * scale
    if causal:
        allowed = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]  # bottom-right aligned
        scores = scores.masked_fill(~allowed, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    return scores, torch.exp(scores - lse[..., None]), lse


class ReferenceFa4Calls:
    """The contract of tapetrain.kernels.flash4.Fa4Calls in plain torch (fp32 inside; outputs in q's dtype)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []  # (kind, D, Dv, packed): what the adapters called

    def fwd(self, q, k, v, *, scale, causal, packing):
        _check(q, k, v, packing)
        self.calls.append(("fwd", q.shape[-1], v.shape[-1], packing is not None))
        cu_q, cu_k = (packing.cu_q, packing.cu_k) if packing else (None, None)
        outs, lses = [], []
        for qs, ks, vs in zip(_sequences(q, cu_q), _sequences(k, cu_k), _sequences(v, cu_k), strict=True):
            _, p, lse = _probs(qs, ks, scale, causal)
            outs.append((p @ _heads_first(vs, qs.shape[1] // vs.shape[1])).transpose(0, 1))  # (T, H, Dv)
            lses.append(lse)
        if packing is None:
            return torch.stack(outs).to(q.dtype), torch.stack(lses)  # (B, T, H, Dv), (B, H, T)
        return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1)  # (N, H, Dv), (H, N)

    def bwd(self, q, k, v, out, dout, lse, *, scale, causal, packing):
        _check(q, k, v, packing)
        assert out.shape == dout.shape == (*q.shape[:-1], v.shape[-1])
        assert lse.dtype == torch.float32
        assert lse.shape == ((q.shape[0], q.shape[2], q.shape[1]) if packing is None else (q.shape[1], q.shape[0]))
        if q.shape[-2] != k.shape[-2]:
            assert q.shape[-1] == v.shape[-1], "GQA backward requires head_dim == head_dim_v (sm90)"
        self.calls.append(("bwd", q.shape[-1], v.shape[-1], packing is not None))
        cu_q, cu_k = (packing.cu_q, packing.cu_k) if packing else (None, None)
        lse_rows = list(lse.unbind(0)) if packing is None else _sequences(lse.transpose(0, 1), cu_q)
        dqs, dks, dvs = [], [], []
        groups = q.shape[-2] // k.shape[-2]
        for qs, ks, vs, os, dos, ls in zip(_sequences(q, cu_q), _sequences(k, cu_k), _sequences(v, cu_k),
                                           _sequences(out, cu_q), _sequences(dout, cu_q), lse_rows, strict=True):
            ls = ls if packing is None else ls.transpose(0, 1)  # (H, T)
            _, p, _ = _probs(qs, ks, scale, causal, lse=ls)
            do, o = _heads_first(dos), _heads_first(os)  # (H, T, Dv)
            dv = p.transpose(1, 2) @ do  # (H, S, Dv)
            dp = do @ _heads_first(vs, groups).transpose(1, 2)  # (H, T, S)
            delta = (do * o).sum(-1, keepdim=True)  # (H, T, 1)
            ds = p * (dp - delta) * scale
            dq = ds @ _heads_first(ks, groups)  # (H, T, D)
            dk = ds.transpose(1, 2) @ _heads_first(qs)  # (H, S, D)

            def fold(x: torch.Tensor) -> torch.Tensor:  # (H, S, ·) -> (S, Hk, ·): GQA sums the group's heads
                return x.view(-1, groups, *x.shape[1:]).sum(1).transpose(0, 1)

            dqs.append(dq.transpose(0, 1))
            dks.append(fold(dk))
            dvs.append(fold(dv))
        join = torch.stack if packing is None else torch.cat
        return join(dqs).to(q.dtype), join(dks).to(k.dtype), join(dvs).to(v.dtype)
