"""Fused rotation of q and k by TAPE's state E in Triton (forward and backward), GQA-aware.

    q (B, T, H, D)   k (B, T, Hkv, D), H % Hkv == 0   E (B, T, H, D) = [c ‖ s] (rotate-half, F = D/2 blocks)
    q̃ = rotate_by_state(q, E),   k̃ = rotate_by_state(k.repeat_interleave(H / Hkv, dim=2), E)   both (B, T, H, D)

A pair (x1, x2) rotated by a block (c, s) becomes (x1·c − x2·s, x2·c + x1·s) (tapetrain.model.positions).

One program per (token tile, kv head g, b): it loads its k tile once and loops over the G = H / Hkv query heads
of its group, so q, k and E are each read once and the expanded k is never materialised. The backward uses the
same grid: per query head it writes dq and dE (E receives both streams' terms), and it sums dk over the group in
registers (fp32), so there are no atomics and no per-head dk buffer: deterministic, one pass.

    dq1 = g1·c + g2·s          dq2 = g2·c − g1·s                      (the inverse rotation of dq̃)
    dc  = Σ_{q,k} (g1·x1 + g2·x2)      ds = Σ_{q,k} (g2·x1 − g1·x2)   (x = q or k, g its upstream grad)

Any strides (q and k are `.view`s of projections, possibly slices of a fused one); outputs and grads are
contiguous (B, T, ·, D). Elementwise work, no tl.dot: the F axis is padded to a power of two and masked.
Saved for backward: q, k, E, i.e. (2·H + Hkv)·D elements per token (eager saves the expanded k: 3·H·D).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tapetrain.kernels.launch import KernelLauncher, Launch, LaunchConfig, interpreting

# --------------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _halves(ptr, row, offs_f, mask, F, sd):
    # the two halves (BT, BF) of rows `row` (BT, 1) int64 offsets: x[:F] and x[F:], in fp32
    base = ptr + row + offs_f[None, :] * sd
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + F * sd, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _store_halves(ptr, row, offs_f, mask, F, sd, x1, x2):
    base = ptr + row + offs_f[None, :] * sd
    tl.store(base, x1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(base + F * sd, x2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_fwd_kernel(
    Q, K, E, QR, KR,
    sqb, sqt, sqh, sqd,
    skb, skt, skh, skd,
    seb, set_, seh, sed,
    sob, sot, soh, sod,
    T, F, GROUP,
    BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    # QR and KR are both contiguous (B, T, H, D): one set of strides (sob, sot, soh, sod).
    pid_t = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_f = tl.arange(0, BLOCK_F)
    mask = (offs_t < T)[:, None] & (offs_f < F)[None, :]
    rows = offs_t[:, None]
    k1, k2 = _halves(K, b * skb + g * skh + rows * skt, offs_f, mask, F, skd)  # (BT, BF) each
    for j in range(GROUP):
        h = g * GROUP + j
        c, s = _halves(E, b * seb + h * seh + rows * set_, offs_f, mask, F, sed)
        out_row = b * sob + h * soh + rows * sot
        _store_halves(KR, out_row, offs_f, mask, F, sod, k1 * c - k2 * s, k2 * c + k1 * s)
        q1, q2 = _halves(Q, b * sqb + h * sqh + rows * sqt, offs_f, mask, F, sqd)
        _store_halves(QR, out_row, offs_f, mask, F, sod, q1 * c - q2 * s, q2 * c + q1 * s)


@triton.jit
def _rotate_bwd_kernel(
    Q, K, E, GQ, GK, DQ, DK, DE,
    sqb, sqt, sqh, sqd,
    skb, skt, skh, skd,
    seb, set_, seh, sed,
    sgqb, sgqt, sgqh, sgqd,
    sgkb, sgkt, sgkh, sgkd,
    sob, sot, soh, sod,
    sdkb, sdkt, sdkh, sdkd,
    T, F, GROUP,
    DQ_ON: tl.constexpr, DK_ON: tl.constexpr, DE_Q: tl.constexpr, DE_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    # DQ and DE are contiguous (B, T, H, D) (strides sob..sod), DK contiguous (B, T, Hkv, D).
    # DQ_ON / DK_ON: write dq / dk; DE_Q / DE_K: E's gradient takes the q / k stream's terms. Each is off when its
    # input needs no gradient or its stream has no upstream gradient (layer 0's E, a None grad of q̃ or k̃).
    pid_t = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_f = tl.arange(0, BLOCK_F)
    mask = (offs_t < T)[:, None] & (offs_f < F)[None, :]
    rows = offs_t[:, None]
    if DE_K:
        k1, k2 = _halves(K, b * skb + g * skh + rows * skt, offs_f, mask, F, skd)
    if DK_ON:
        dk1 = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)  # the group sum of dk, in registers
        dk2 = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)
    for j in range(GROUP):
        h = g * GROUP + j
        c, s = _halves(E, b * seb + h * seh + rows * set_, offs_f, mask, F, sed)
        dc = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)
        ds = tl.zeros([BLOCK_T, BLOCK_F], tl.float32)
        out_row = b * sob + h * soh + rows * sot
        if DK_ON or DE_K:
            g1, g2 = _halves(GK, b * sgkb + h * sgkh + rows * sgkt, offs_f, mask, F, sgkd)
            if DK_ON:
                dk1 += g1 * c + g2 * s
                dk2 += g2 * c - g1 * s
            if DE_K:
                dc += g1 * k1 + g2 * k2
                ds += g2 * k1 - g1 * k2
        if DQ_ON or DE_Q:
            g1, g2 = _halves(GQ, b * sgqb + h * sgqh + rows * sgqt, offs_f, mask, F, sgqd)
            if DQ_ON:
                _store_halves(DQ, out_row, offs_f, mask, F, sod, g1 * c + g2 * s, g2 * c - g1 * s)
            if DE_Q:
                q1, q2 = _halves(Q, b * sqb + h * sqh + rows * sqt, offs_f, mask, F, sqd)
                dc += g1 * q1 + g2 * q2
                ds += g2 * q1 - g1 * q2
        if DE_Q or DE_K:
            _store_halves(DE, out_row, offs_f, mask, F, sod, dc, ds)
    if DK_ON:
        _store_halves(DK, b * sdkb + g * sdkh + rows * sdkt, offs_f, mask, F, sdkd, dk1, dk2)


# --------------------------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------------------------
# BLOCK_T, num_warps, num_stages per kernel. Memory-bound elementwise work: the tile only has to keep enough
# loads in flight without spilling; every dtype is fp32 in registers (ptxas at D = 128 on sm_80 and sm_90a, bf16,
# fp16 and fp32: 64-96 registers, no spills; report_launches).
_CONFIGS = {"fwd": LaunchConfig.of(4, 1, BLOCK_T=32), "bwd": LaunchConfig.of(4, 1, BLOCK_T=16)}
_launcher = KernelLauncher("tape_rotate_qk", _rotate_fwd_kernel)


def _config(kind: str) -> LaunchConfig:
    if interpreting():
        return LaunchConfig.of(1, 1, BLOCK_T=8)  # the CPU tests cover several token tiles and a partial one
    return _CONFIGS[kind]


# --------------------------------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------------------------------


def _check(q: torch.Tensor, k: torch.Tensor, state: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or state.dim() != 4:
        raise ValueError("tape_rotate_qk expects token-major 4-D tensors (B, T, H, D)")
    b, t, h, d = q.shape
    if state.shape != q.shape or k.shape[:2] != (b, t) or k.shape[3] != d:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, state {tuple(state.shape)}")
    if h % k.shape[2]:
        raise ValueError(f"kv heads must divide query heads: H={h}, Hkv={k.shape[2]}")
    if d % 2:
        raise ValueError(f"the head dim must be even (rotate-half pairs); got {d}")
    _launcher.check_inputs(dict(q=q, k=k, state=state), same_dtype=("q", "k", "state"))


def _grid(q: torch.Tensor, k: torch.Tensor, config: LaunchConfig) -> tuple[int, int, int]:
    return triton.cdiv(q.shape[1], config["BLOCK_T"]), k.shape[2], q.shape[0]


def _forward(q: torch.Tensor, k: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, t, h, d = q.shape
    q_rot = torch.empty(b, t, h, d, device=q.device, dtype=q.dtype)
    k_rot = torch.empty_like(q_rot)
    args = (q, k, state, q_rot, k_rot, *q.stride(), *k.stride(), *state.stride(), *q_rot.stride(),
            t, d // 2, h // k.shape[2])  # fmt: skip
    _launcher.launch(_rotate_fwd_kernel, "_rotate_fwd_kernel", lambda c: _grid(q, k, c), [_config("fwd")], args,
                     dict(BLOCK_F=triton.next_power_of_2(d // 2)))  # fmt: skip
    return q_rot, k_rot


def _backward(q, k, state, gq: torch.Tensor | None, gk: torch.Tensor | None, needs: tuple[bool, bool, bool]):
    """(dq, dk, d_state), each None where not needed or without terms, from the upstream grads of q̃ and k̃ (None:
    no gradient); `needs` says which of q, k, state want a gradient."""
    dq_on, dk_on = needs[0] and gq is not None, needs[1] and gk is not None
    de_q, de_k = needs[2] and gq is not None, needs[2] and gk is not None
    if not (dq_on or dk_on or de_q or de_k):
        return None, None, None
    b, t, h, d = q.shape
    dq = torch.empty(b, t, h, d, device=q.device, dtype=q.dtype) if dq_on else None
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype) if dk_on else None
    de = torch.empty(b, t, h, d, device=q.device, dtype=state.dtype) if de_q or de_k else None
    # dummies for absent tensors: never dereferenced (constexpr-guarded); dq and de: contiguous (B, T, H, D)
    gq_, gk_ = (gq if gq is not None else q), (gk if gk is not None else q)
    out_ = next(x for x in (dq, de, dk) if x is not None)
    dq_, dk_, de_ = (x if x is not None else out_ for x in (dq, dk, de))
    args = (q, k, state, gq_, gk_, dq_, dk_, de_,
            *q.stride(), *k.stride(), *state.stride(), *gq_.stride(), *gk_.stride(), t * h * d, h * d, d, 1,
            *dk_.stride(), t, d // 2, h // k.shape[2])  # fmt: skip
    consts = dict(DQ_ON=dq_on, DK_ON=dk_on, DE_Q=de_q, DE_K=de_k, BLOCK_F=triton.next_power_of_2(d // 2))
    _launcher.launch(_rotate_bwd_kernel, "_rotate_bwd_kernel", lambda c: _grid(q, k, c), [_config("bwd")], args,
                     consts)  # fmt: skip
    return dq, dk, de


# ---- torch custom ops: opaque to torch.compile (no graph break), autograd through register_autograd -------------


@torch.library.custom_op("tapetrain::tape_rotate_qk", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, state)


@_fwd_op.register_fake
def _fwd_fake(q, k, state):
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        q, memory_format=torch.contiguous_format
    )


@torch.library.custom_op("tapetrain::tape_rotate_qk_bwd", mutates_args=())
def _bwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    state: torch.Tensor,
    gq: torch.Tensor | None,
    gk: torch.Tensor | None,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _backward(q, k, state, gq, gk, tuple(needs))
    return tuple(x if x is not None else q.new_empty(0) for x in grads)  # empty stands for "no gradient"


@_bwd_op.register_fake
def _bwd_fake(q, k, state, gq, gk, needs):
    empty = q.new_empty(0)
    has = (gq is not None, gk is not None, gq is not None or gk is not None)
    return tuple(
        torch.empty(x.shape, dtype=x.dtype, device=x.device) if need and ok else empty
        for x, need, ok in zip((q, k, state), needs, has, strict=True)
    )


def _setup_context(ctx, inputs, output) -> None:
    q, k, state = inputs
    ctx.q_shape, ctx.k_shape = q.shape, k.shape
    if not ctx.needs_input_grad[2]:  # layer 0's E^(0): dq, dk need only E, so q and k are not kept
        q, k = q.new_empty(0), k.new_empty(0)
    ctx.save_for_backward(q, k, state)  # the expanded k is never saved
    ctx.set_materialize_grads(False)  # a None upstream grad stays None: that stream's terms are skipped


def _autograd_backward(ctx, gq, gk):
    q, k, state = ctx.saved_tensors
    needs = [bool(x) for x in ctx.needs_input_grad]
    if not needs[2]:  # q, k were not kept: stand-ins of their shapes (stride 0, no memory) that the kernel never reads
        q, k = q.new_empty(()).expand(ctx.q_shape), k.new_empty(()).expand(ctx.k_shape)
    grads = _bwd_op(q, k, state, gq, gk, needs)
    return tuple(g if n and g.numel() else None for g, n in zip(grads, needs, strict=True))


torch.library.register_autograd("tapetrain::tape_rotate_qk", _autograd_backward, setup_context=_setup_context)


def tape_rotate_qk(q: torch.Tensor, k: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, T, H, D), k (B, T, Hkv, D), TAPE's state E (B, T, H, D) -> (q̃, k̃), both (B, T, H, D) contiguous:
    `rotate_by_state(q, E)` and `rotate_by_state(k.repeat_interleave(H // Hkv, dim=2), E)` in one pass."""
    _check(q, k, state)
    return _fwd_op(q, k, state)


# --------------------------------------------------------------------------------------------------------------
# Kernel report
# --------------------------------------------------------------------------------------------------------------

REPORT_SHAPES = {"llama-1b": (1, 2048, 16, 16, 128), "llama2-7b": (1, 4096, 32, 32, 128)}  # B, T, H, Hkv, D


def report_launches(arch: int, dtype: torch.dtype) -> list[Launch]:
    """The launches of one forward + backward at REPORT_SHAPES on meta tensors, plus the backward of the first
    layer, whose E^(0) needs no gradient, for compute capability `arch` (which does not change the choice);
    labelled by shape."""
    records: list[Launch] = []
    for label, (b, t, h, hkv, d) in REPORT_SHAPES.items():
        q, state = (torch.empty(b, t, h, d, device="meta", dtype=dtype) for _ in range(2))
        k = torch.empty(b, t, hkv, d, device="meta", dtype=dtype)
        shape = f"{label}: B={b} T={t} H={h} Hkv={hkv} D={d}"
        with _launcher.capture(arch, shape=shape) as launches:
            q_rot, k_rot = _forward(q, k, state)
            gq, gk = torch.empty_like(q_rot), torch.empty_like(k_rot)
            _backward(q, k, state, gq, gk, (True, True, True))
        records += launches
        with _launcher.capture(arch, shape=shape + ", layer 0 (no d_state)") as launches:
            _backward(q, k, state, gq, gk, (True, True, False))
        records += launches
    return records
