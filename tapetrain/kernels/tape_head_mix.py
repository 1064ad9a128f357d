"""TAPE's attention-side state update E ← E + (A·E) ×_heads W_A in Triton, residual fused (forward and backward).

    state (B, T, M, D)   attended = A·E (B, T, M, D)   weight (M, M) 'full' or (M,) 'gain'
    full:  out[b, t] = state[b, t] + W @ attended[b, t]          (an (M, M) @ (M, D) product per token)
    gain:  out[b, t] = state[b, t] + w[:, None] * attended[b, t]

As in TapeHeadMix, the weight is cast to attended's dtype before use; products and the residual add are fp32 and
the result is rounded once. In the model `attended` is the token-major view of the attention kernel's heads-first
(B, M, T, D) output: any strides are read as they are.

One program per (chunk of TOKENS tokens, block of D columns, b): it loads W once and walks its tokens (see
TILE for why D is split). Backward, same grid:
    d_state = dout (returned as is, no kernel)
    d_attended[t] = Wᵀ @ dout[t]  (full)   or  w[:, None] * dout[t]  (gain)
    d_W = Σ_t dout[t] @ attended[t]ᵀ  (full)   or  Σ_{t,d} dout ⊙ attended  (gain)
d_W is accumulated per program in fp32 and each program writes its own partial, (programs, M, M) or (programs, M)
(padding included), summed in torch: deterministic, no atomics. tl.dot tiles are padded to ≥ 16 (M and D) and masked.
Saved for backward: attended and the weight, i.e. M·D elements per token (the same as eager's matmul/mul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tapetrain.kernels.launch import KernelLauncher, Launch, LaunchConfig, dot_precision, interpreting, pad_for_dot

# --------------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _mix_fwd_kernel(
    S, A, W, OUT,
    ssb, sst, ssm, ssd,
    sab, sat, sam, sad,
    swm, swn,
    sob, sot, som, sod,
    T, M, D, TOKENS,
    FULL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_M)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md_ok = (offs_m < M)[:, None] & (offs_d < D)[None, :]
    if FULL:
        w = tl.load(
            W + offs_m[:, None] * swm + offs_n[None, :] * swn,
            mask=(offs_m < M)[:, None] & (offs_n < M)[None, :],
            other=0.0,
        )  # (BM, BM)
        w = w.to(A.dtype.element_ty)
    else:
        w = tl.load(W + offs_m * swm, mask=offs_m < M, other=0.0).to(A.dtype.element_ty).to(tl.float32)  # (BM,)
    # scalar pointers to the chunk's first token, advanced a token per iteration; the (BM, BD) offset tiles are
    # formed in the loop (pointer tiles carried across iterations would hold 2 registers per element)
    start = pid.to(tl.int64) * TOKENS
    a_row = A + b * sab + start * sat
    s_row = S + b * ssb + start * sst
    o_row = OUT + b * sob + start * sot
    for _ in range(0, tl.minimum(TOKENS, T - start)):
        a = tl.load(a_row + offs_m[:, None] * sam + offs_d[None, :] * sad, mask=md_ok, other=0.0)  # (BM, BD)
        if FULL:
            mixed = tl.dot(w, a, input_precision=PRECISION)  # (BM, BD) fp32
        else:
            mixed = a.to(tl.float32) * w[:, None]
        s = tl.load(s_row + offs_m[:, None] * ssm + offs_d[None, :] * ssd, mask=md_ok, other=0.0)
        out = s.to(tl.float32) + mixed
        tl.store(o_row + offs_m[:, None] * som + offs_d[None, :] * sod, out.to(OUT.dtype.element_ty), mask=md_ok)
        a_row += sat
        s_row += sst
        o_row += sot


@triton.jit
def _mix_bwd_kernel(
    A, W, G, DA, DW,
    sab, sat, sam, sad,
    swm, swn,
    sgb, sgt, sgm, sgd,
    sdb, sdt, sdm, sdd,
    T, M, D, TOKENS,
    FULL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # G = dout; DA = d_attended, contiguous (B, T, M, D); DW: this program's fp32 partial of d_W at
    # DW + program · BLOCK_M² ((BM, BM) full) or DW + program · BLOCK_M ((BM,) gain), padding included.
    pid = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_M)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md_ok = (offs_m < M)[:, None] & (offs_d < D)[None, :]
    if FULL:
        wt = tl.load(
            W + offs_m[:, None] * swn + offs_n[None, :] * swm,
            mask=(offs_m < M)[:, None] & (offs_n < M)[None, :],
            other=0.0,
        )  # Wᵀ (BM, BM)
        wt = wt.to(A.dtype.element_ty)
        dw = tl.zeros([BLOCK_M, BLOCK_M], tl.float32)
    else:
        w = tl.load(W + offs_m * swm, mask=offs_m < M, other=0.0).to(A.dtype.element_ty).to(tl.float32)
        dw = tl.zeros([BLOCK_M], tl.float32)
    start = pid.to(tl.int64) * TOKENS
    a_row = A + b * sab + start * sat  # scalar pointers, as in the forward
    g_row = G + b * sgb + start * sgt
    da_row = DA + b * sdb + start * sdt
    for _ in range(0, tl.minimum(TOKENS, T - start)):
        g = tl.load(g_row + offs_m[:, None] * sgm + offs_d[None, :] * sgd, mask=md_ok, other=0.0)  # (BM, BD)
        if FULL:
            # aᵀ (BD, BM) straight from memory: the backward needs a only transposed, as a dot operand
            at = tl.load(a_row + offs_d[:, None] * sad + offs_m[None, :] * sam, mask=tl.trans(md_ok), other=0.0)
            g = g.to(A.dtype.element_ty)  # tl.dot takes one dtype
            da = tl.dot(wt, g, input_precision=PRECISION)  # (BM, BD)
            dw += tl.dot(g, at, input_precision=PRECISION)  # (BM, BM): Σ_d dout[m, d] · a[n, d]
        else:
            a = tl.load(a_row + offs_m[:, None] * sam + offs_d[None, :] * sad, mask=md_ok, other=0.0)
            g = g.to(tl.float32)
            da = g * w[:, None]
            dw += tl.sum(g * a.to(tl.float32), 1)
        tl.store(da_row + offs_m[:, None] * sdm + offs_d[None, :] * sdd, da.to(DA.dtype.element_ty), mask=md_ok)
        a_row += sat
        g_row += sgt
        da_row += sdt
    program = (b * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + pid
    if FULL:
        tl.store(DW + program * BLOCK_M * BLOCK_M + offs_m[:, None] * BLOCK_M + offs_n[None, :], dw)
    else:
        tl.store(DW + program * BLOCK_M + offs_m, dw)


# --------------------------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------------------------
# TOKENS per program trades parallelism against W loads and d_W partials (programs · M² fp32). D is split into
# blocks of at most TILE // BLOCK_M columns (a grid axis; d_W partials per block too): with whole (32, 128) tiles the
# bf16 backward took 176-188 registers a thread (4 or 8 warps), with (32, 64) ones 107-128, no spills (ptxas,
# report_launches).
TOKENS = 16
TILE = 2048  # elements of one (BLOCK_M, BLOCK_D) tile


_launcher = KernelLauncher("tape_head_mix", _mix_fwd_kernel)


def _block_d(block_m: int, d: int) -> int:
    return max(16, min(pad_for_dot(d), TILE // block_m))


def _config(m: int, d: int) -> LaunchConfig:
    """The one config: its BLOCK_D also sets the grid and the number of d_W partials, sized before the launch."""
    warps, stages = (1, 1) if interpreting() else (4, 1)
    return LaunchConfig.of(warps, stages, BLOCK_D=_block_d(pad_for_dot(m), d))


def _tokens() -> int:
    return 4 if interpreting() else TOKENS  # the CPU tests cover several chunks and a partial one


# --------------------------------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------------------------------


def _check(state: torch.Tensor, attended: torch.Tensor, weight: torch.Tensor) -> None:
    if state.dim() != 4 or attended.shape != state.shape:
        raise ValueError(f"state and attended must be (B, T, M, D); got {tuple(state.shape)}, {tuple(attended.shape)}")
    m = state.shape[2]
    if weight.shape not in ((m, m), (m,)):
        raise ValueError(f"weight must be (M, M) ('full') or (M,) ('gain') with M = {m}; got {tuple(weight.shape)}")
    _launcher.check_inputs(dict(state=state, attended=attended, weight=weight), same_dtype=("state", "attended"),
                           float_dtype=("weight",))  # fmt: skip


def _grid(attended: torch.Tensor) -> tuple[int, int, int]:
    _, t, m, d = attended.shape
    return triton.cdiv(t, _tokens()), triton.cdiv(d, _config(m, d)["BLOCK_D"]), attended.shape[0]


def _forward(state: torch.Tensor, attended: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    b, t, m, d = state.shape
    out = torch.empty(b, t, m, d, device=state.device, dtype=state.dtype)
    w_strides = weight.stride() if weight.dim() == 2 else (weight.stride(0), 0)
    args = (state, attended, weight, out, *state.stride(), *attended.stride(), *w_strides, *out.stride(),
            t, m, d, _tokens())  # fmt: skip
    consts = dict(FULL=weight.dim() == 2, PRECISION=dot_precision(attended.dtype), BLOCK_M=pad_for_dot(m))
    grid = _grid(attended)
    _launcher.launch(_mix_fwd_kernel, "_mix_fwd_kernel", lambda c: grid, [_config(m, d)], args, consts)
    return out


def _backward(attended: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_attended, d_weight) from dout; d_state is dout itself."""
    b, t, m, d = attended.shape
    full = weight.dim() == 2
    block_m = pad_for_dot(m)
    grid = _grid(attended)
    d_att = torch.empty(b, t, m, d, device=attended.device, dtype=attended.dtype)
    programs = grid[0] * grid[1] * grid[2]
    partial_shape = (programs, block_m, block_m) if full else (programs, block_m)
    partials = torch.empty(partial_shape, device=attended.device, dtype=torch.float32)
    w_strides = weight.stride() if full else (weight.stride(0), 0)
    args = (attended, weight, grad, d_att, partials, *attended.stride(), *w_strides, *grad.stride(), *d_att.stride(),
            t, m, d, _tokens())  # fmt: skip
    consts = dict(FULL=full, PRECISION=dot_precision(attended.dtype), BLOCK_M=block_m)
    _launcher.launch(_mix_bwd_kernel, "_mix_bwd_kernel", lambda c: grid, [_config(m, d)], args, consts)
    d_w = partials.sum(0)[:m, :m] if full else partials.sum(0)[:m]
    return d_att, d_w.to(weight.dtype).contiguous()  # contiguous, as the fake says


# ---- torch custom ops: opaque to torch.compile (no graph break), autograd through register_autograd -------------


@torch.library.custom_op("tapetrain::tape_head_mix", mutates_args=())
def _fwd_op(state: torch.Tensor, attended: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _forward(state, attended, weight)


@_fwd_op.register_fake
def _fwd_fake(state, attended, weight):
    return torch.empty(state.shape, dtype=state.dtype, device=state.device)


@torch.library.custom_op("tapetrain::tape_head_mix_bwd", mutates_args=())
def _bwd_op(attended: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(attended, weight, grad)


@_bwd_op.register_fake
def _bwd_fake(attended, weight, grad):
    d_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return torch.empty(attended.shape, dtype=attended.dtype, device=attended.device), d_w


def _setup_context(ctx, inputs, output) -> None:
    _, attended, weight = inputs
    ctx.save_for_backward(attended, weight)  # not the state: its gradient is dout


def _autograd_backward(ctx, grad):
    attended, weight = ctx.saved_tensors
    need_state, need_att, need_w = ctx.needs_input_grad
    if not (need_att or need_w):
        return grad if need_state else None, None, None
    d_att, d_w = _bwd_op(attended, weight, grad)
    return grad if need_state else None, d_att if need_att else None, d_w if need_w else None


torch.library.register_autograd("tapetrain::tape_head_mix", _autograd_backward, setup_context=_setup_context)


def tape_head_mix(state: torch.Tensor, attended: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """state + mixed (B, T, M, D): mixed = weight @ attended per token for weight (M, M) ('full'), or
    attended · weight[:, None] for weight (M,) ('gain'); TapeHeadMix.forward with the residual fused in."""
    _check(state, attended, weight)
    return _fwd_op(state, attended, weight)


# --------------------------------------------------------------------------------------------------------------
# Kernel report
# --------------------------------------------------------------------------------------------------------------

REPORT_SHAPES = {"llama-1b": (1, 2048, 16, 128), "llama2-7b": (1, 4096, 32, 128)}  # B, T, M, D


def report_launches(arch: int, dtype: torch.dtype) -> list[Launch]:
    """The launches of one forward + backward, 'full' and 'gain', at REPORT_SHAPES on meta tensors for compute
    capability `arch` (which does not change them), labelled by shape."""
    records: list[Launch] = []
    for label, (b, t, m, d) in REPORT_SHAPES.items():
        for mode, w_shape in (("full", (m, m)), ("gain", (m,))):
            state = torch.empty(b, t, m, d, device="meta", dtype=dtype)
            attended = torch.empty(b, m, t, d, device="meta", dtype=dtype).transpose(1, 2)  # the model's view
            weight = torch.empty(w_shape, device="meta", dtype=torch.float32)
            with _launcher.capture(arch, shape=f"{label} {mode}: B={b} T={t} M={m} D={d}") as launches:
                out = _forward(state, attended, weight)
                _backward(attended, weight, torch.empty_like(out))
            records += launches
    return records
