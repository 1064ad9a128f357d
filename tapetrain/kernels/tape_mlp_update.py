"""Fused TAPE MLP-side state update in Triton (forward and backward), without the (B, T, I, D) intermediate.

Per token n (b, t), contractions over the head axis only (tapetrain.model.tape.TapeMlpUpdate):

    state E_n (M, D)   gate logits x_n = W_x m_n (I,)   W_up (I, M)   W_down (M, I)
    g = SiLU(x_n) (I,)   up = W_up E_n (I, D)   h = g ⊙ up (I, D)   out_n = E_n + W_down h (M, D)

Eager materialises up and h, (B, T, I, D) each (I = 4·M: 4× E), and saves both for backward. Here:

Forward: one program per (tile of BLOCK_T tokens, b); per token it walks I in chunks of BLOCK_I, computing the
chunk's up (BI, D) with one tl.dot, gating it and feeding W_down's columns into an fp32 (M, D) accumulator that
starts as E_n (the residual). Nothing of size I·D leaves registers.

Backward (saves only the inputs; up is recomputed): with dO_n (M, D) and gd = W_downᵀ dO_n (I, D),
    d_state = dO + W_upᵀ (g ⊙ gd)             d_x = SiLU'(x) ⊙ Σ_d gd ⊙ up
    d_W_down = Σ_{n,d} dO ⊙ h  (M, I)          d_W_up = Σ_{n,d} (g ⊙ gd) E_nᵀ  (I, M)
Two kernels: `_bwd_state_kernel` (per token tile, like the forward: d_state, d_x) and `_bwd_weight_kernel`
(per token tile × I chunk: fp32 partial weight gradients in registers, written per program and summed in torch;
no atomics, so deterministic).

Constraints / notes:
  * Any strides (passed to the kernels); a state whose last dim is strided is copied once (uncoalesced loads).
  * The weights and gate logits are cast to the state's dtype (fp32/fp16/bf16) outside the op, as eager matmuls
    require one dtype; accumulation is fp32; fp32 on CUDA uses tf32 dots iff torch allows tf32 matmuls.
  * Tiles are padded to powers of two ≥ 16 (tl.dot) and masked: M = 12 computes on 16 rows.
  * Runs on CUDA, or on CPU under TRITON_INTERPRET=1 set before triton is imported (as tape_attention).
  * Not double-differentiable.
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
def _fwd_kernel(
    E, G, WU, WD, Out,
    seb, set_, sem, sed,
    sgb, sgt, sgi,
    swui, swum, swdm, swdi,
    sob, sot, som, sod,
    T, M, CH, D,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program per (token tile, b); tokens one after the other, I in chunks.
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_i0 = tl.arange(0, BLOCK_I)
    m_ok = offs_m < M
    md_ok = m_ok[:, None] & (offs_d[None, :] < D)
    t0 = pid_t.to(tl.int64) * BLOCK_T  # int64 token offsets: T · stride may pass 2³¹
    for t in range(t0, tl.minimum(t0 + BLOCK_T, T)):
        e = tl.load(E + b * seb + t * set_ + offs_m[:, None] * sem + offs_d[None, :] * sed, mask=md_ok, other=0.0)
        acc = e.to(tl.float32)  # (BM, BD): the residual, then += W_down h chunk by chunk
        for i0 in range(0, CH, BLOCK_I):
            offs_i = i0 + offs_i0
            i_ok = offs_i < CH
            wu = tl.load(WU + offs_i[:, None] * swui + offs_m[None, :] * swum,
                         mask=i_ok[:, None] & m_ok[None, :], other=0.0)  # (BI, BM)
            wd = tl.load(WD + offs_m[:, None] * swdm + offs_i[None, :] * swdi,
                         mask=m_ok[:, None] & i_ok[None, :], other=0.0)  # (BM, BI)
            x = tl.load(G + b * sgb + t * sgt + offs_i * sgi, mask=i_ok, other=0.0).to(tl.float32)  # (BI,)
            gate = x * tl.sigmoid(x)
            up = tl.dot(wu, e, input_precision=PRECISION)  # (BI, BD) fp32
            h = (up * gate[:, None]).to(e.dtype)
            acc += tl.dot(wd, h, input_precision=PRECISION)
        tl.store(Out + b * sob + t * sot + offs_m[:, None] * som + offs_d[None, :] * sod,
                 acc.to(Out.dtype.element_ty), mask=md_ok)  # fmt: skip


@triton.jit
def _bwd_state_kernel(
    E, G, WU, WD, DO, DE, DG,
    seb, set_, sem, sed,
    sgb, sgt, sgi,
    swui, swum, swdm, swdi,
    sdob, sdot, sdom, sdod,
    sdeb, sdet, sdem, sded,
    sdgb, sdgt, sdgi,
    T, M, CH, D,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # d_state (M, D) and d_x (I,) per token; up is recomputed chunk by chunk.
    pid_t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_i0 = tl.arange(0, BLOCK_I)
    m_ok = offs_m < M
    md_ok = m_ok[:, None] & (offs_d[None, :] < D)
    t0 = pid_t.to(tl.int64) * BLOCK_T  # int64 token offsets: T · stride may pass 2³¹
    for t in range(t0, tl.minimum(t0 + BLOCK_T, T)):
        e = tl.load(E + b * seb + t * set_ + offs_m[:, None] * sem + offs_d[None, :] * sed, mask=md_ok, other=0.0)
        do = tl.load(DO + b * sdob + t * sdot + offs_m[:, None] * sdom + offs_d[None, :] * sdod,
                     mask=md_ok, other=0.0)  # (BM, BD)
        acc = do.to(tl.float32)  # d_state: the residual's dO, then += W_upᵀ (g ⊙ gd)
        for i0 in range(0, CH, BLOCK_I):
            offs_i = i0 + offs_i0
            i_ok = offs_i < CH
            im_ok = i_ok[:, None] & m_ok[None, :]
            wu = tl.load(WU + offs_i[:, None] * swui + offs_m[None, :] * swum, mask=im_ok, other=0.0)  # (BI, BM)
            wdt = tl.load(WD + offs_i[:, None] * swdi + offs_m[None, :] * swdm, mask=im_ok, other=0.0)  # W_downᵀ
            x = tl.load(G + b * sgb + t * sgt + offs_i * sgi, mask=i_ok, other=0.0).to(tl.float32)  # (BI,)
            sig = tl.sigmoid(x)
            up = tl.dot(wu, e, input_precision=PRECISION)  # (BI, BD)
            gd = tl.dot(wdt, do, input_precision=PRECISION)  # (BI, BD) = W_downᵀ dO
            dx = tl.sum(gd * up, 1) * (sig * (1.0 + x * (1.0 - sig)))  # SiLU'(x) = σ(x)(1 + x(1 − σ(x)))
            tl.store(DG + b * sdgb + t * sdgt + offs_i * sdgi, dx.to(DG.dtype.element_ty), mask=i_ok)
            dh = (gd * (x * sig)[:, None]).to(e.dtype)  # (BI, BD)
            acc += tl.dot(tl.trans(wu), dh, input_precision=PRECISION)
        tl.store(DE + b * sdeb + t * sdet + offs_m[:, None] * sdem + offs_d[None, :] * sded,
                 acc.to(DE.dtype.element_ty), mask=md_ok)  # fmt: skip


@triton.jit
def _bwd_weight_kernel(
    E, G, WU, WD, DO, DWU, DWD,
    seb, set_, sem, sed,
    sgb, sgt, sgi,
    swui, swum, swdm, swdi,
    sdob, sdot, sdom, sdod,
    T, M, CH, D, N_TILES,
    PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One program per (token tile, I chunk, b): fp32 partials of d_W_up (BI, BM) and d_W_down (BM, BI) over its
    # tokens, stored at partial index p = b · N_TILES + tile of DWU (P, I, M) and DWD (P, M, I), contiguous.
    # Every column d contributes independently, so D is walked in BLOCK_D chunks (fp32 uses half of D at a time).
    pid_t = tl.program_id(0)
    pid_i = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d0 = tl.arange(0, BLOCK_D)
    offs_i = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    m_ok = offs_m < M
    i_ok = offs_i < CH
    im_ok = i_ok[:, None] & m_ok[None, :]
    wu = tl.load(WU + offs_i[:, None] * swui + offs_m[None, :] * swum, mask=im_ok, other=0.0)  # (BI, BM)
    wdt = tl.load(WD + offs_i[:, None] * swdi + offs_m[None, :] * swdm, mask=im_ok, other=0.0)  # (BI, BM)
    acc_wu = tl.zeros([BLOCK_I, BLOCK_M], tl.float32)
    acc_wd = tl.zeros([BLOCK_M, BLOCK_I], tl.float32)
    t0 = pid_t.to(tl.int64) * BLOCK_T  # int64 token offsets: T · stride may pass 2³¹
    for t in range(t0, tl.minimum(t0 + BLOCK_T, T)):
        x = tl.load(G + b * sgb + t * sgt + offs_i * sgi, mask=i_ok, other=0.0).to(tl.float32)
        gate = x * tl.sigmoid(x)  # (BI,)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + offs_d0
            md_ok = m_ok[:, None] & (offs_d[None, :] < D)
            e = tl.load(E + b * seb + t * set_ + offs_m[:, None] * sem + offs_d[None, :] * sed, mask=md_ok,
                        other=0.0)  # (BM, BD)
            do = tl.load(DO + b * sdob + t * sdot + offs_m[:, None] * sdom + offs_d[None, :] * sdod,
                         mask=md_ok, other=0.0)  # (BM, BD)
            up = tl.dot(wu, e, input_precision=PRECISION)  # (BI, BD)
            gd = tl.dot(wdt, do, input_precision=PRECISION)  # (BI, BD)
            h = (up * gate[:, None]).to(e.dtype)
            dh = (gd * gate[:, None]).to(e.dtype)
            acc_wd += tl.dot(do, tl.trans(h), input_precision=PRECISION)  # Σ_d dO h: (BM, BI)
            acc_wu += tl.dot(dh, tl.trans(e), input_precision=PRECISION)  # Σ_d dh Eᵀ: (BI, BM)
    p = b * N_TILES + pid_t
    tl.store(DWU + p * CH * M + offs_i[:, None] * M + offs_m[None, :], acc_wu, mask=im_ok)
    tl.store(DWD + p * M * CH + offs_m[:, None] * CH + offs_i[None, :], acc_wd, mask=m_ok[:, None] & i_ok[None, :])


# --------------------------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------------------------

# (BLOCK_T tokens per program, BLOCK_I channels per chunk, num_warps, num_stages). Chosen for zero register spills
# on sm_80 and sm_90a at the llama-1b and llama2-7b shapes (tools/kernel_report.py); not yet timed on a GPU.
_launcher = KernelLauncher("tape_mlp_update", _fwd_kernel)


def _configs(kind: str, dtype: torch.dtype, block_m: int, block_d: int) -> list[LaunchConfig]:
    """Configs to try for kernel `kind` (fwd | dstate | dweight), best first; later ones after OutOfResources.
    All configs of one kind share BLOCK_T: dweight's partial buffers are sized by it before the launch."""
    return [LaunchConfig.of(warps, stages, BLOCK_T=bt, BLOCK_I=bi) for bt, bi, warps, stages in
            _config_rows(kind, dtype, block_m, block_d)]  # fmt: skip


def _config_rows(kind: str, dtype: torch.dtype, block_m: int, block_d: int) -> list[tuple[int, int, int, int]]:
    if interpreting():
        return [(4, 16, 1, 1)]  # several programs and I chunks even at test shapes
    fp32 = dtype == torch.float32  # twice the registers per element: 8 warps, and smaller chunks when wide
    wide = block_m * block_d >= 4096  # (32, 128) tiles: spread over 8 warps
    warps = 8 if wide or fp32 else 4
    if kind == "dweight":  # two fp32 weight accumulators live across the token loop: 16-channel chunks
        return [(128, 16, warps, 1 if fp32 else 2), (128, 16, 8, 1)]  # (128, 32, 8, 2) spills at M = 32
    if fp32 and wide:
        return [(16, 16, 8, 1)]
    return [(16, 32, warps, 2), (16, 16, warps, 1), (16, 16, 8, 1)]


def _weight_block_d(dtype: torch.dtype, d: int) -> int:
    """D chunk of the weight-gradient kernel: all of D in 16-bit; fp32 tiles of 128 columns spill, so 64."""
    return min(pad_for_dot(d), 64) if dtype == torch.float32 and not interpreting() else pad_for_dot(d)


def _launch(kernel, kind: str, grid_of, dtype: torch.dtype, block_m: int, block_d: int, *args, **consts) -> None:
    """Launch with the first config that compiles; grid_of(BLOCK_T, BLOCK_I) -> grid."""
    key = (kind, args[0].device.index, dtype, block_m, block_d)
    _launcher.launch(kernel, kernel.fn.__name__, lambda c: grid_of(c["BLOCK_T"], c["BLOCK_I"]),
                     _configs(kind, dtype, block_m, block_d), args, consts, key=key)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# Launch code (real or meta tensors)
# --------------------------------------------------------------------------------------------------------------


def _consts(state: torch.Tensor) -> dict:
    m, d = state.shape[2], state.shape[3]
    return dict(PRECISION=dot_precision(state.dtype), BLOCK_M=pad_for_dot(m), BLOCK_D=pad_for_dot(d))


def _forward(state, gate_logits, up_weight, down_weight) -> torch.Tensor:
    b, t, m, d = state.shape
    i = up_weight.shape[0]
    out = torch.empty(b, t, m, d, device=state.device, dtype=state.dtype)
    c = _consts(state)
    _launch(
        _fwd_kernel, "fwd", lambda bt, bi: (triton.cdiv(t, bt), b), state.dtype, c["BLOCK_M"], c["BLOCK_D"],
        state, gate_logits, up_weight, down_weight, out,
        *state.stride(), *gate_logits.stride(), *up_weight.stride(), *down_weight.stride(), *out.stride(),
        t, m, i, d, **c,
    )  # fmt: skip
    return out


def _backward(state, gate_logits, up_weight, down_weight, dout, needs: tuple[bool, ...]):
    """(d_state, d_gate_logits, d_up_weight, d_down_weight), None where `needs` says no."""
    b, t, m, d = state.shape
    i = up_weight.shape[0]
    dout = dout.to(state.dtype)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    c = _consts(state)
    d_state = d_gate = d_up = d_down = None
    if needs[0] or needs[1]:
        d_state = torch.empty(b, t, m, d, device=state.device, dtype=state.dtype)
        d_gate = torch.empty(b, t, i, device=state.device, dtype=gate_logits.dtype)
        _launch(
            _bwd_state_kernel, "dstate", lambda bt, bi: (triton.cdiv(t, bt), b), state.dtype, c["BLOCK_M"],
            c["BLOCK_D"],
            state, gate_logits, up_weight, down_weight, dout, d_state, d_gate,
            *state.stride(), *gate_logits.stride(), *up_weight.stride(), *down_weight.stride(), *dout.stride(),
            *d_state.stride(), *d_gate.stride(),
            t, m, i, d, **c,
        )  # fmt: skip
    if needs[2] or needs[3]:
        bt = _configs("dweight", state.dtype, c["BLOCK_M"], c["BLOCK_D"])[0]["BLOCK_T"]  # every dweight config
        n_tiles = triton.cdiv(t, bt)
        # fp32 partials per (b, token tile); programs of one tile write disjoint I chunks of the same slot
        part_up = torch.empty(b * n_tiles, i, m, device=state.device, dtype=torch.float32)
        part_down = torch.empty(b * n_tiles, m, i, device=state.device, dtype=torch.float32)
        _launch(
            _bwd_weight_kernel, "dweight", lambda bt_, bi: (triton.cdiv(t, bt_), triton.cdiv(i, bi), b),
            state.dtype, c["BLOCK_M"], c["BLOCK_D"],
            state, gate_logits, up_weight, down_weight, dout, part_up, part_down,
            *state.stride(), *gate_logits.stride(), *up_weight.stride(), *down_weight.stride(), *dout.stride(),
            t, m, i, d, n_tiles, **dict(c, BLOCK_D=_weight_block_d(state.dtype, d)),
        )  # fmt: skip
        d_up = part_up.sum(0).to(up_weight.dtype)
        d_down = part_down.sum(0).to(down_weight.dtype)
    return (d_state if needs[0] else None, d_gate if needs[1] else None, d_up if needs[2] else None,
            d_down if needs[3] else None)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# torch custom ops: opaque to torch.compile (no graph break), autograd through register_autograd
# --------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("tapetrain::tape_mlp_update_fwd", mutates_args=())
def _fwd_op(state: torch.Tensor, gate_logits: torch.Tensor, up_weight: torch.Tensor,
            down_weight: torch.Tensor) -> torch.Tensor:  # fmt: skip
    return _forward(state, gate_logits, up_weight, down_weight)


@_fwd_op.register_fake
def _fwd_fake(state, gate_logits, up_weight, down_weight):
    return state.new_empty(state.shape)


@torch.library.custom_op("tapetrain::tape_mlp_update_bwd", mutates_args=())
def _bwd_op(state: torch.Tensor, gate_logits: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor,
            dout: torch.Tensor, needs: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _backward(state, gate_logits, up_weight, down_weight, dout, tuple(needs))
    return tuple(g if g is not None else state.new_empty(0) for g in grads)  # empty stands for "not needed"


@_bwd_op.register_fake
def _bwd_fake(state, gate_logits, up_weight, down_weight, dout, needs):
    empty = state.new_empty(0)
    like = (state, gate_logits, up_weight, down_weight)
    return tuple(x.new_empty(x.shape) if n else empty for x, n in zip(like, needs, strict=True))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)  # inputs only: up (B, T, I, D) is recomputed in the backward


def _autograd_backward(ctx, dout):
    needs = [bool(x) for x in ctx.needs_input_grad]
    grads = _bwd_op(*ctx.saved_tensors, dout, needs)
    return tuple(g if n else None for g, n in zip(grads, needs, strict=True))


torch.library.register_autograd("tapetrain::tape_mlp_update_fwd", _autograd_backward, setup_context=_setup_context)


def _check(state, gate_logits, up_weight, down_weight) -> None:
    if state.dim() != 4 or gate_logits.dim() != 3 or up_weight.dim() != 2 or down_weight.dim() != 2:
        raise ValueError("tape_mlp_update expects state (B, T, M, D), gate_logits (B, T, I), up_weight (I, M), "
                         "down_weight (M, I)")  # fmt: skip
    b, t, m, _ = state.shape
    i = up_weight.shape[0]
    if tuple(gate_logits.shape) != (b, t, i) or tuple(up_weight.shape) != (i, m) or \
            tuple(down_weight.shape) != (m, i):  # fmt: skip
        raise ValueError(f"shape mismatch: state {tuple(state.shape)}, gate_logits {tuple(gate_logits.shape)}, "
                         f"up_weight {tuple(up_weight.shape)}, down_weight {tuple(down_weight.shape)}")
    _launcher.check_inputs(dict(state=state, gate_logits=gate_logits, up_weight=up_weight, down_weight=down_weight),
                           same_dtype=("state",))  # fmt: skip


def tape_mlp_update(state: torch.Tensor, gate_logits: torch.Tensor, up_weight: torch.Tensor,
                    down_weight: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """state + W_down (SiLU(gate_logits) ⊙ (W_up state)), contracted over heads; see the module docstring.

    state (B, T, M, D) token-major, any strides; gate_logits (B, T, I) = W_x m before the SiLU; up_weight (I, M)
    (up_proj.weight); down_weight (M, I) (down_proj.weight). Returns (B, T, M, D) contiguous, in state's dtype.
    """
    _check(state, gate_logits, up_weight, down_weight)
    dtype = state.dtype
    state = state if state.stride(-1) == 1 else state.contiguous()
    return _fwd_op(state, gate_logits.to(dtype), up_weight.to(dtype), down_weight.to(dtype))


# --------------------------------------------------------------------------------------------------------------
# Kernel report (tools/kernel_report.py)
# --------------------------------------------------------------------------------------------------------------

# (name, M, I, D): the model shapes whose launches the kernel report compiles
REPORT_SHAPES = [("llama-1b", 16, 64, 128), ("llama2-7b", 32, 128, 128)]


def report_launches(arch: int, dtype: torch.dtype) -> list[Launch]:
    """The launches of one forward + backward at each REPORT_SHAPES shape (B = 2, T = 2048, meta tensors) for
    compute capability `arch`, labelled by shape (e.g. "llama-1b M=16 I=64 D=128"); the configs do not depend on
    `arch` yet (one table for sm_80 and sm_90a)."""
    records: list[Launch] = []
    for label, m, i, d in REPORT_SHAPES:
        b, t = 2, 2048
        state = torch.empty(b, t, m, d, device="meta", dtype=dtype)
        gate = torch.empty(b, t, i, device="meta", dtype=dtype)
        up, down = torch.empty(i, m, device="meta", dtype=dtype), torch.empty(m, i, device="meta", dtype=dtype)
        with _launcher.capture(arch, shape=f"{label} M={m} I={i} D={d}") as launches:
            _forward(state, gate, up, down)
            _backward(state, gate, up, down, torch.empty_like(state), (True, True, True, True))
        records += launches
    return records
