"""Fused TAPE attention in Triton: A·V and A·E from one softmax, flash-style (A is never materialised).

Per batch b and query head h (shapes as in tapetrain.model.attention):

    q (B, H, T, D)   k (B, Hk, S, D)   v (B, Hv, S, Dv)   e (B, H, S, De) or None
    (e: the heads-first view E.transpose(1, 2) of TAPE's token-major state E (B, S, M, De), M = H; the model
    passes q, k, v as such views too, so every load reads rows of D contiguous numbers)
    A = softmax(q_h k_{h // (H/Hk)}^T * scale + causal mask)       (T × S), causal bottom-right aligned
    o = A · v_{h // (H/Hv)}      (B, H, T, Dv)
    o_e = A · e_h                (B, H, T, De)

Forward: one program per (query tile, h, b); it walks the key tiles once with an online softmax, computing
QK^T once over D and feeding two fp32 accumulators (value columns of v and of e). It saves the natural-log
logsumexp (B, H, T) fp32 for the backward.

Backward (exact, both streams): with dO = [do ‖ do_e], O = [o ‖ o_e],
    delta = rowsum(dO ⊙ O)  (over BOTH streams),   dP = do·v^T + do_e·e^T,   dS = P ⊙ (dP − delta)
    dq = scale·dS·k,   dk = scale·dS^T·q,   dv = P^T·do,   de = P^T·do_e
The E stream feeds dq/dk through dP and delta (the reference TAPE code dropped those terms). Two kernels, no
atomics (deterministic): one per key tile for dk/dv/de, one per query tile for dq. With GQA, dk/dv are computed
per query head into (B, H, S, ·) fp32 buffers and the groups summed in torch.

Constraints / notes:
  * Any T, S (partial tiles masked); any strides (strides are passed to the kernels, nothing is made
    contiguous). q, k, v, e must share dtype (fp32/fp16/bf16) and device; accumulation is fp32.
  * Head dims D, Dv, De need not be powers of two: tiles are padded to the next power of two ≥ 16 (tl.dot needs
    ≥ 16) and the padding columns are masked on load/store; padding costs compute, so prefer powers of two.
  * Query rows that can see no key (only possible with causal and T > S) return 0 (eager returns NaN).
  * fp32 inputs on CUDA use tf32 dots iff torch.backends.cuda.matmul.allow_tf32, else IEEE fp32.
  * TRITON_INTERPRET=1 must be set before triton is first imported to run on CPU (triton.jit reads it at
    decoration time, and since triton 3.9 parts of triton.language such as tl.zeros are @triton.jit functions
    built at triton's import); the interpreter uses small 16×16 tiles.
  * Not double-differentiable.
  * Packed documents (q_doc (B, T), k_doc (B, S) int ids, contiguous runs, non-decreasing along a row): a query
    attends only to keys of its own document. Besides the per-pair mask inside a tile, whole key tiles outside the
    query tile's documents are skipped: the wrapper gives each query the key range of its document
    (QLO/QHI, searchsorted on the sorted ids) and each key its query range (KLO/KHI), which bound the loops.
"""

from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl

from tapetrain.kernels.launch import KernelLauncher, Launch, LaunchConfig, dot_precision, interpreting, pad_for_dot

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# --------------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _doc_key_range(QLO, QHI, b, pid_m, T, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Key range [lo, hi) of query tile pid_m's documents: from the first row's document start (rounded down to a
    # key tile) to the last row's document end (ids are non-decreasing, so these bound every row's keys).
    first = pid_m * BLOCK_M
    last = tl.minimum(first + BLOCK_M, T) - 1
    lo = tl.load(QLO + b * T + first)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(hi, tl.load(QHI + b * T + last))
    return lo, hi


@triton.jit
def _doc_query_range(KLO, KHI, b, pid_n, S, lo, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Query range [lo, hi) of key tile pid_n's documents (the transpose of _doc_key_range).
    first = pid_n * BLOCK_N
    last = tl.minimum(first + BLOCK_N, S) - 1
    lo = tl.maximum(lo, tl.load(KLO + b * S + first))
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = tl.minimum(T, tl.load(KHI + b * S + last))
    return lo, hi


@triton.jit
def _fwd_kernel(
    Q, K, V, E, Out, OutE, LSE,
    sqb, sqh, sqt, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    seb, seh, ses, sed,
    sob, soh, sot, sod,
    seob, seoh, seot, seod,
    QDOC, KDOC, QLO, QHI,
    H, T, S, D, DV, DE, GROUP_K, GROUP_V,
    scale_log2,
    CAUSAL: tl.constexpr, HAS_E: tl.constexpr, PRECISION: tl.constexpr, HAS_DOC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DE: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_de = tl.arange(0, BLOCK_DE)
    m_ok = offs_m < T

    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
        mask=m_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )  # (BM, BD)
    k_base = K + b * skb + (h // GROUP_K) * skh
    v_base = V + b * svb + (h // GROUP_V) * svh
    e_base = E + b * seb + h * seh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp2
    acc_v = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc_e = tl.zeros([BLOCK_M, BLOCK_DE], tl.float32)

    off = S - T  # query t sits at absolute position off + t
    hi = S
    if CAUSAL:  # keys beyond the last row's position are fully masked: skip those tiles
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M + off)
    lo = 0
    if HAS_DOC:  # only the key tiles of this query tile's documents
        q_doc = tl.load(QDOC + b * T + offs_m, mask=m_ok, other=-1)
        lo, hi = _doc_key_range(QLO, QHI, b, pid_m, T, hi, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < S
        kt = tl.load(
            k_base + offs_n[None, :] * sks + offs_d[:, None] * skd,
            mask=n_ok[None, :] & (offs_d[:, None] < D),
            other=0.0,
        )  # (BD, BN)
        qk = tl.dot(q, kt, input_precision=PRECISION) * scale_log2  # (BM, BN), log2 domain
        valid = n_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + off)
        if HAS_DOC:
            k_doc = tl.load(KDOC + b * S + offs_n, mask=n_ok, other=-2)
            valid = valid & (q_doc[:, None] == k_doc[None, :])
        qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: avoid inf - inf
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + offs_n[:, None] * svs + offs_dv[None, :] * svd,
            mask=n_ok[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )  # (BN, BDV)
        acc_v = acc_v * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        if HAS_E:
            e = tl.load(
                e_base + offs_n[:, None] * ses + offs_de[None, :] * sed,
                mask=n_ok[:, None] & (offs_de[None, :] < DE),
                other=0.0,
            )  # (BN, BDE)
            acc_e = acc_e * alpha[:, None] + tl.dot(p.to(e.dtype), e, input_precision=PRECISION)
        m_i = m_new

    has_key = l_i > 0.0
    inv_l = 1.0 / tl.where(has_key, l_i, 1.0)
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + (b * H + h) * T + offs_m, lse, mask=m_ok)
    tl.store(
        Out + b * sob + h * soh + offs_m[:, None] * sot + offs_dv[None, :] * sod,
        (acc_v * inv_l[:, None]).to(Out.dtype.element_ty),
        mask=m_ok[:, None] & (offs_dv[None, :] < DV),
    )
    if HAS_E:
        tl.store(
            OutE + b * seob + h * seoh + offs_m[:, None] * seot + offs_de[None, :] * seod,
            (acc_e * inv_l[:, None]).to(OutE.dtype.element_ty),
            mask=m_ok[:, None] & (offs_de[None, :] < DE),
        )


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, E, DO, DOE, LSE, DELTA, DK, DV_, DE_,
    sqb, sqh, sqt, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    seb, seh, ses, sed,
    sdob, sdoh, sdot, sdod,
    sdeob, sdeoh, sdeot, sdeod,
    sdkb, sdkh, sdks, sdkd,
    sdvb, sdvh, sdvs, sdvd,
    sdeb, sdeh, sdes, sded,
    QDOC, KDOC, KLO, KHI,
    H, T, S, D, DV, DE, GROUP_K, GROUP_V,
    scale, scale_log2,
    CAUSAL: tl.constexpr, USE_V: tl.constexpr, USE_E: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DE: tl.constexpr,
    DO_DKDV: tl.constexpr = True, DO_DE: tl.constexpr = True, HAS_DOC: tl.constexpr = False,
):  # fmt: skip
    # One program per (key tile, query head h, b): dk/dv/de of that key tile as seen by query head h.
    # USE_V / USE_E: whether do / do_e exist (a None upstream grad drops that stream's terms).
    # DO_DKDV / DO_DE: which accumulators this pass keeps. At D = 128 the three (BN, D) fp32 accumulators of
    # dk, dv and de do not fit the register file next to the operand tiles, so de gets its own pass
    # (recomputing P costs 1/7 of the backward's FLOPs; spilling costs more).
    pid_n = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_de = tl.arange(0, BLOCK_DE)
    n_ok = offs_n < S

    k = tl.load(
        K + b * skb + (h // GROUP_K) * skh + offs_n[:, None] * sks + offs_d[None, :] * skd,
        mask=n_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )  # (BN, BD)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    de = tl.zeros([BLOCK_N, BLOCK_DE], tl.float32)
    if USE_V and DO_DKDV:
        v = tl.load(
            V + b * svb + (h // GROUP_V) * svh + offs_n[:, None] * svs + offs_dv[None, :] * svd,
            mask=n_ok[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )  # (BN, BDV)
    if USE_E and DO_DKDV:
        e = tl.load(
            E + b * seb + h * seh + offs_n[:, None] * ses + offs_de[None, :] * sed,
            mask=n_ok[:, None] & (offs_de[None, :] < DE),
            other=0.0,
        )  # (BN, BDE)

    q_base = Q + b * sqb + h * sqh
    do_base = DO + b * sdob + h * sdoh
    doe_base = DOE + b * sdeob + h * sdeoh
    row_base = (b * H + h) * T
    off = S - T
    lo = 0
    if CAUSAL:  # queries before this tile's first key position see none of it
        lo = tl.maximum(0, pid_n * BLOCK_N - off)
        lo = (lo // BLOCK_M) * BLOCK_M
    hi = T
    if HAS_DOC:  # only the query tiles of this key tile's documents
        k_doc = tl.load(KDOC + b * S + offs_n, mask=n_ok, other=-2)
        lo, hi = _doc_query_range(KLO, KHI, b, pid_n, S, lo, T, BLOCK_M, BLOCK_N)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        m_ok = offs_m < T
        qt = tl.load(
            q_base + offs_m[None, :] * sqt + offs_d[:, None] * sqd,
            mask=m_ok[None, :] & (offs_d[:, None] < D),
            other=0.0,
        )  # (BD, BM)
        lse2 = tl.load(LSE + row_base + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
        valid = n_ok[:, None] & m_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :] + off)
        if HAS_DOC:
            q_doc = tl.load(QDOC + b * T + offs_m, mask=m_ok, other=-1)
            valid = valid & (k_doc[:, None] == q_doc[None, :])
        qkt = tl.dot(k, qt, input_precision=PRECISION) * scale_log2  # (BN, BM)
        pt = tl.where(valid, tl.exp2(qkt - lse2[None, :]), 0.0)  # P^T, fp32
        if USE_E:
            doe = tl.load(
                doe_base + offs_m[:, None] * sdeot + offs_de[None, :] * sdeod,
                mask=m_ok[:, None] & (offs_de[None, :] < DE),
                other=0.0,
            )  # (BM, BDE)
            if DO_DE:
                de += tl.dot(pt.to(doe.dtype), doe, input_precision=PRECISION)
        if DO_DKDV:
            dpt = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            if USE_V:
                do = tl.load(
                    do_base + offs_m[:, None] * sdot + offs_dv[None, :] * sdod,
                    mask=m_ok[:, None] & (offs_dv[None, :] < DV),
                    other=0.0,
                )  # (BM, BDV)
                dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
                dpt += tl.dot(v, tl.trans(do), input_precision=PRECISION)
            if USE_E:
                dpt += tl.dot(e, tl.trans(doe), input_precision=PRECISION)
            dst = pt * (dpt - delta[None, :])  # dS^T (BN, BM)
            dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PRECISION)

    if DO_DKDV:
        dk = dk * scale
        tl.store(
            DK + b * sdkb + h * sdkh + offs_n[:, None] * sdks + offs_d[None, :] * sdkd,
            dk.to(DK.dtype.element_ty),
            mask=n_ok[:, None] & (offs_d[None, :] < D),
        )
        if USE_V:
            tl.store(
                DV_ + b * sdvb + h * sdvh + offs_n[:, None] * sdvs + offs_dv[None, :] * sdvd,
                dv.to(DV_.dtype.element_ty),
                mask=n_ok[:, None] & (offs_dv[None, :] < DV),
            )
    if USE_E and DO_DE:
        tl.store(
            DE_ + b * sdeb + h * sdeh + offs_n[:, None] * sdes + offs_de[None, :] * sded,
            de.to(DE_.dtype.element_ty),
            mask=n_ok[:, None] & (offs_de[None, :] < DE),
        )


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, E, DO, DOE, LSE, DELTA, DQ,
    sqb, sqh, sqt, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    seb, seh, ses, sed,
    sdob, sdoh, sdot, sdod,
    sdeob, sdeoh, sdeot, sdeod,
    sdqb, sdqh, sdqt, sdqd,
    QDOC, KDOC, QLO, QHI,
    H, T, S, D, DV, DE, GROUP_K, GROUP_V,
    scale, scale_log2,
    CAUSAL: tl.constexpr, USE_V: tl.constexpr, USE_E: tl.constexpr, PRECISION: tl.constexpr,
    HAS_DOC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DE: tl.constexpr,
):  # fmt: skip
    # One program per (query tile, h, b): dq = scale · sum over key tiles of dS · k.
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_de = tl.arange(0, BLOCK_DE)
    m_ok = offs_m < T

    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :] * sqd,
        mask=m_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )  # (BM, BD)
    if USE_V:
        do = tl.load(
            DO + b * sdob + h * sdoh + offs_m[:, None] * sdot + offs_dv[None, :] * sdod,
            mask=m_ok[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )  # (BM, BDV)
    if USE_E:
        doe = tl.load(
            DOE + b * sdeob + h * sdeoh + offs_m[:, None] * sdeot + offs_de[None, :] * sdeod,
            mask=m_ok[:, None] & (offs_de[None, :] < DE),
            other=0.0,
        )  # (BM, BDE)
    row_base = (b * H + h) * T
    lse2 = tl.load(LSE + row_base + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
    k_base = K + b * skb + (h // GROUP_K) * skh
    v_base = V + b * svb + (h // GROUP_V) * svh
    e_base = E + b * seb + h * seh
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    off = S - T
    hi = S
    if CAUSAL:
        hi = tl.minimum(S, (pid_m + 1) * BLOCK_M + off)
    lo = 0
    if HAS_DOC:
        q_doc = tl.load(QDOC + b * T + offs_m, mask=m_ok, other=-1)
        lo, hi = _doc_key_range(QLO, QHI, b, pid_m, T, hi, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < S
        k = tl.load(
            k_base + offs_n[:, None] * sks + offs_d[None, :] * skd,
            mask=n_ok[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )  # (BN, BD)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (BM, BN)
        valid = m_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + off)
        if HAS_DOC:
            k_doc = tl.load(KDOC + b * S + offs_n, mask=n_ok, other=-2)
            valid = valid & (q_doc[:, None] == k_doc[None, :])
        p = tl.where(valid, tl.exp2(qk - lse2[:, None]), 0.0)
        dp = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if USE_V:
            vt = tl.load(
                v_base + offs_n[None, :] * svs + offs_dv[:, None] * svd,
                mask=n_ok[None, :] & (offs_dv[:, None] < DV),
                other=0.0,
            )  # (BDV, BN)
            dp += tl.dot(do, vt, input_precision=PRECISION)
        if USE_E:
            et = tl.load(
                e_base + offs_n[None, :] * ses + offs_de[:, None] * sed,
                mask=n_ok[None, :] & (offs_de[:, None] < DE),
                other=0.0,
            )  # (BDE, BN)
            dp += tl.dot(doe, et, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)

    dq = dq * scale
    tl.store(
        DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :] * sdqd,
        dq.to(DQ.dtype.element_ty),
        mask=m_ok[:, None] & (offs_d[None, :] < D),
    )


# --------------------------------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------------------------------

_launcher = KernelLauncher("tape_attention", _fwd_kernel)
# the kernel report's name of each launch kind (de: the dk/dv kernel's separate de pass)
LAUNCH_NAMES = {"fwd": "_fwd_kernel", "dq": "_bwd_dq_kernel", "dkdv": "_bwd_dkdv_kernel", "de": "_bwd_dkdv_kernel:de"}
_forced: dict[str, LaunchConfig] = {}  # kind -> config, set by force_config (tuning sweeps)


def _config(block_m: int, block_n: int, num_warps: int, num_stages: int) -> LaunchConfig:
    return LaunchConfig.of(num_warps, num_stages, BLOCK_M=block_m, BLOCK_N=block_n)


def force_config(kind: str, config: tuple[int, int, int, int] | None) -> None:
    """Use `config` (BLOCK_M, BLOCK_N, num_warps, num_stages) for every launch of `kind` (fwd | dkdv | de | dq)
    until reset with None; for tuning sweeps."""
    if kind not in LAUNCH_NAMES:
        raise ValueError(f"unknown kernel kind {kind!r}; choose fwd, dkdv, de or dq")
    if config is None:
        _forced.pop(kind, None)
    else:
        _forced[kind] = _config(*config)
    _launcher.forget_chosen()


# Launch configs (BLOCK_M, BLOCK_N, num_warps, num_stages) per (arch family, kernel, padded head dim), in order of
# preference: the first is the fastest measured on that arch (tools/tune_attention.py on an H100 for sm_90) among
# those with zero register spills on it (ptxas, tools/kernel_report.py); later ones are fallbacks, tried when the
# compiler reports OutOfResources (GPUs with less shared memory). sm_80's rows are chosen for zero spills and A100's
# 164 KB of shared memory (no A100 measurement yet).
_TABLE: dict[tuple[int, str, int], list[tuple[int, int, int, int]]] = {
    # ---- Hopper (sm_90): H100 measurements, bf16, B·H = 32, T = 4096 (docs/benchmarks/gpu/)
    (90, "fwd", 64): [(64, 64, 4, 3), (64, 64, 4, 2)],
    (90, "fwd", 128): [(128, 64, 8, 3), (64, 64, 8, 2)],
    (90, "dq", 64): [(64, 64, 4, 2), (64, 32, 4, 2)],
    (90, "dq", 128): [(128, 64, 8, 2), (64, 32, 4, 2)],
    (90, "dkdv", 64): [(64, 64, 4, 3), (32, 64, 4, 3)],
    (90, "dkdv", 128): [(32, 64, 4, 2), (32, 128, 8, 3)],  # dk, dv only: de has its own pass at D = 128
    (90, "de", 128): [(32, 64, 4, 3), (64, 128, 8, 3)],
    # ---- Ampere (sm_80): chosen for zero spills under sm_80's mma layouts and A100's shared memory
    (80, "fwd", 64): [(64, 64, 4, 3), (64, 64, 4, 2)],
    (80, "fwd", 128): [(64, 64, 8, 2), (64, 32, 4, 2)],
    (80, "dq", 64): [(64, 64, 4, 2), (64, 32, 4, 2)],
    (80, "dq", 128): [(64, 64, 8, 2), (64, 32, 4, 2)],
    (80, "dkdv", 64): [(32, 128, 8, 2), (32, 32, 4, 2)],
    (80, "dkdv", 128): [(32, 64, 8, 2), (16, 64, 4, 2)],
    (80, "de", 128): [(64, 64, 4, 2), (32, 64, 4, 2)],
}
_FALLBACK = [(32, 32, 4, 1), (16, 16, 4, 1)]

# The Hopper search space of the TAPE case (values V and E, value width 2D) at head dims 64 and 128, 16-bit: the
# table's Hopper choices first (the baseline), then a grid of tiles × warps. The kernel report compiles every
# candidate for sm_90a and records its registers and spills (docs/benchmarks/kernel-report.json, "candidate": true);
# tools/tune_attention.py times the zero-spill ones on a GPU, and the fastest of those per kernel is what the table's
# Hopper rows should list first. The grid is small because each candidate costs a compile (seconds) per head dim.
_HOPPER_GRID = {
    "fwd": ((128, 64), (64, 32), (8, 4), (3,)),
    "dq": ((128, 64), (64, 32), (8, 4), (2,)),
    "dkdv": ((32, 64), (64, 128), (4, 8), (2,)),
    "de": ((32, 64), (64, 128), (4, 8), (3,)),  # the separate de pass (D = 128)
}
HOPPER_CANDIDATES: dict[str, list[LaunchConfig]] = {
    kind: list(dict.fromkeys(
        [_config(*_TABLE[90, kind, d][0]) for d in (64, 128) if (90, kind, d) in _TABLE]
        + [_config(*c) for c in itertools.product(*grid)]
    ))
    for kind, grid in _HOPPER_GRID.items()
}  # fmt: skip


def _split_de(arch: int, block_d: int, dtype: torch.dtype) -> bool:
    """Whether de gets its own backward pass: where the table lists a "de" config (16-bit, large head dims)."""
    if interpreting() or dtype == torch.float32:
        return False
    return (_family(arch), "de", min(max(block_d, 64), 128)) in _TABLE


def _family(arch: int) -> int:
    """The table rows for compute capability `arch`: Hopper's on 9.x (chosen by ptxas for sm_90a and timed on the
    H100); sm_80's elsewhere (Ampere and Ada share its register file; on newer archs neither was measured, and
    sm_80's ask for less shared memory)."""
    return 90 if arch // 10 == 9 else 80


def _configs(kind: str, arch: int, block_d: int, dtype: torch.dtype) -> list[LaunchConfig]:
    """Configs to try for kernel `kind` (fwd | dkdv | de | dq) on compute capability `arch` (e.g. 90) at padded
    head dim `block_d`; 16-bit inputs use the table, fp32 (twice the registers per element) small tiles."""
    if kind in _forced:
        return [_forced[kind]]
    if interpreting():
        return [_config(16, 16, 1, 1)]
    if dtype == torch.float32:
        rows = [(64, 32, 4, 2), (32, 32, 4, 1)] + _FALLBACK
    else:
        rows = _TABLE[_family(arch), kind, min(max(block_d, 64), 128)] + _FALLBACK
    return [_config(*row) for row in rows]


def _launch(kernel, kind: str, key: tuple, grid_of, block_d: int, dtype: torch.dtype, *args, **consts) -> None:
    """Launch with the first config that compiles for this key; grid_of(BLOCK_M, BLOCK_N) -> grid."""
    configs = _configs(kind, _launcher.arch(args[0]), block_d, dtype)
    _launcher.launch(kernel, LAUNCH_NAMES[kind], lambda c: grid_of(c["BLOCK_M"], c["BLOCK_N"]), configs, args,
                     consts, key=None if kind in _forced else key)  # fmt: skip


def _strides(x: torch.Tensor | None) -> tuple[int, int, int, int]:
    return (0, 0, 0, 0) if x is None else tuple(x.stride())


# --------------------------------------------------------------------------------------------------------------
# Autograd wrapper
# --------------------------------------------------------------------------------------------------------------


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor | None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or (e is not None and e.dim() != 4):
        raise ValueError("tape_attention expects heads-first 4-D tensors (B, H, T, D)")
    b, h, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[3] != d or k.shape[2] != v.shape[2]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if h % k.shape[1] or h % v.shape[1]:
        raise ValueError(f"kv heads must divide query heads: H={h}, Hk={k.shape[1]}, Hv={v.shape[1]}")
    if e is not None and (e.shape[0] != b or e.shape[1] != h or e.shape[2] != k.shape[2]):
        raise ValueError(f"e must be (B, H, S, De) = ({b}, {h}, {k.shape[2]}, De); got {tuple(e.shape)}")
    _launcher.check_inputs(dict(q=q, k=k, v=v, e=e), same_dtype=("q", "k", "v", "e"))


def _dims(q, k, v, e):
    b, h, t, d = q.shape
    s = k.shape[2]
    dv = v.shape[3]
    de = e.shape[3] if e is not None else 0
    return b, h, t, s, d, dv, de, h // k.shape[1], h // v.shape[1]


def _empty_heads_first_view(x: torch.Tensor, b: int, h: int, t: int, d: int,
                            dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """An uninitialised heads-first (B, H, T, D) view of token-major (B, T, H, D) memory: the kernels index heads
    first, while the projections produce and consume token-major memory, so the output feeds o_proj (and TAPE's
    token-major state) without a transposing copy."""
    return torch.empty(b, t, h, d, device=x.device, dtype=dtype or x.dtype).transpose(1, 2)


def _unit_last_stride(x: torch.Tensor | None) -> torch.Tensor | None:
    """Tiles are loaded along the last dim: a strided last dim would make every load uncoalesced (many times
    slower than one copy), so such inputs are copied once."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def _doc_ranges(q_doc: torch.Tensor | None, k_doc: torch.Tensor | None, dummy: torch.Tensor):
    """(q_doc (B, T), k_doc (B, S), q_lo, q_hi (B, T), k_lo, k_hi (B, S)) int32 contiguous: each query's key
    range [q_lo, q_hi) and each key's query range [k_lo, k_hi) of its document; dummies without documents."""
    if q_doc is None:
        return (dummy,) * 6
    q_doc, k_doc = q_doc.to(torch.int32).contiguous(), k_doc.to(torch.int32).contiguous()
    q_lo = torch.searchsorted(k_doc, q_doc, side="left").to(torch.int32)
    q_hi = torch.searchsorted(k_doc, q_doc, side="right").to(torch.int32)
    k_lo = torch.searchsorted(q_doc, k_doc, side="left").to(torch.int32)
    k_hi = torch.searchsorted(q_doc, k_doc, side="right").to(torch.int32)
    return q_doc, k_doc, q_lo, q_hi, k_lo, k_hi


def _forward(q, k, v, e, causal: bool, scale: float, q_doc=None, k_doc=None):
    b, h, t, s, d, dv, de, gk, gv = _dims(q, k, v, e)
    o = _empty_heads_first_view(q, b, h, t, dv)
    oe = _empty_heads_first_view(q, b, h, t, de) if e is not None else None
    lse = torch.empty(b, h, t, device=q.device, dtype=torch.float32)
    bd, bdv, bde = pad_for_dot(d), pad_for_dot(dv), pad_for_dot(max(de, 1))
    key = ("fwd", q.device.index, q.dtype, bd, bdv, bde if e is not None else 0)
    qd, kd, q_lo, q_hi, _, _ = _doc_ranges(q_doc, k_doc, lse)
    _launch(
        _fwd_kernel, "fwd", key, lambda bm, bn: (triton.cdiv(t, bm), h, b), bd, q.dtype,
        q, k, v, e if e is not None else v, o, oe if oe is not None else o, lse,
        *q.stride(), *k.stride(), *v.stride(), *_strides(e), *o.stride(), *_strides(oe),
        qd, kd, q_lo, q_hi,
        h, t, s, d, dv, max(de, 1), gk, gv, scale * LOG2E,
        CAUSAL=causal, HAS_E=e is not None, PRECISION=dot_precision(q.dtype), HAS_DOC=q_doc is not None,
        BLOCK_D=bd, BLOCK_DV=bdv, BLOCK_DE=bde,
    )  # fmt: skip
    return o, oe, lse


def _sum_groups(per_head: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, S, D) fp32 per query head -> (B, H / groups, S, D) in `dtype`, a heads-first view of token-major
    memory (GQA key/value grads)."""
    b, h, s, d = per_head.shape
    out = _empty_heads_first_view(per_head, b, h // groups, s, d, dtype)
    out.copy_(per_head.unflatten(1, (h // groups, groups)).sum(2))
    return out


def _backward_impl(q, k, v, e, o, oe, lse, do, doe, causal: bool, scale: float, needs: tuple[bool, ...],
                   q_doc=None, k_doc=None):
    """(dq, dk, dv, de, None, None); `needs` says which of q, k, v, e want a gradient."""
    need_q, need_k, need_v, need_e = needs
    use_v = do is not None
    use_e = doe is not None and e is not None
    if not (use_v or use_e):
        return None, None, None, None, None, None
    b, h, t, s, d, dv, de, gk, gv = _dims(q, k, v, e)
    # tl.dot needs both operands in one dtype
    do = _unit_last_stride(do.to(q.dtype)) if use_v else None
    doe = _unit_last_stride(doe.to(q.dtype)) if use_e else None

    # delta (B, H, T) fp32 = rowsum(dO ⊙ O) over both streams; memory-bound, so plain torch is fine here.
    delta = torch.zeros(b, h, t, device=q.device, dtype=torch.float32)
    if use_v:
        delta += (do.float() * o.float()).sum(-1)
    if use_e:
        delta += (doe.float() * oe.float()).sum(-1)

    bd, bdv, bde = pad_for_dot(d), pad_for_dot(dv), pad_for_dot(max(de, 1))
    # dummies for absent streams: never dereferenced (constexpr-guarded), any valid pointer will do
    e_ = e if use_e else v
    do_ = do if use_v else q
    doe_ = doe if use_e else q
    common = dict(CAUSAL=causal, USE_V=use_v, USE_E=use_e, PRECISION=dot_precision(q.dtype),
                  BLOCK_D=bd, BLOCK_DV=bdv, BLOCK_DE=bde, HAS_DOC=q_doc is not None)  # fmt: skip
    qd, kd, q_lo, q_hi, k_lo, k_hi = _doc_ranges(q_doc, k_doc, lse)
    key_tail = (q.device.index, q.dtype, bd, bdv, bde, use_v, use_e)

    dq = dk = dv_ = de_ = None
    if need_q:
        dq = _empty_heads_first_view(q, b, h, t, d)
        _launch(
            _bwd_dq_kernel, "dq", ("dq", *key_tail), lambda bm, bn: (triton.cdiv(t, bm), h, b), bd, q.dtype,
            q, k, v, e_, do_, doe_, lse, delta, dq,
            *q.stride(), *k.stride(), *v.stride(), *_strides(e_), *_strides(do_), *_strides(doe_), *dq.stride(),
            qd, kd, q_lo, q_hi,
            h, t, s, d, dv, max(de, 1), gk, gv, scale, scale * LOG2E, **common,
        )  # fmt: skip
    if need_k or need_v or need_e:
        # per query head buffers; fp32 when a group of heads must still be summed
        dk_h = _empty_heads_first_view(q, b, h, s, d, k.dtype if gk == 1 else torch.float32)
        dv_h = _empty_heads_first_view(q, b, h, s, dv, v.dtype if gv == 1 else torch.float32)
        de_h = _empty_heads_first_view(q, b, h, s, de, e.dtype) if use_e else dk_h
        dkdv_args = (
            q, k, v, e_, do_, doe_, lse, delta, dk_h, dv_h, de_h,
            *q.stride(), *k.stride(), *v.stride(), *_strides(e_), *_strides(do_), *_strides(doe_),
            *dk_h.stride(), *dv_h.stride(), *de_h.stride(),
            qd, kd, k_lo, k_hi,
            h, t, s, d, dv, max(de, 1), gk, gv, scale, scale * LOG2E,
        )  # fmt: skip
        grid = lambda bm, bn: (triton.cdiv(s, bn), h, b)  # noqa: E731
        split = use_e and _split_de(_launcher.arch(q), bd, q.dtype)
        _launch(_bwd_dkdv_kernel, "dkdv", ("dkdv", split, *key_tail), grid, bd, q.dtype, *dkdv_args, **common,
                DO_DKDV=True, DO_DE=not split)  # fmt: skip
        if split:  # de = P^T · do_e in its own pass (see the kernel)
            _launch(_bwd_dkdv_kernel, "de", ("de", *key_tail), grid, bd, q.dtype, *dkdv_args, **common,
                    DO_DKDV=False, DO_DE=True)  # fmt: skip
        if need_k:
            dk = dk_h if gk == 1 else _sum_groups(dk_h, gk, k.dtype)
        if need_v and use_v:
            dv_ = dv_h if gv == 1 else _sum_groups(dv_h, gv, v.dtype)
        if need_e and use_e:
            de_ = de_h
    return dq, dk, dv_, de_, None, None


# ---- torch custom ops: opaque to torch.compile (no graph break), autograd through register_autograd -------------


@torch.library.custom_op(
    "tapetrain::tape_attention_fwd",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? e, bool causal, float scale, Tensor? q_doc=None, "
    "Tensor? k_doc=None) -> (Tensor, Tensor, Tensor)",
)
def _fwd_op(q, k, v, e, causal, scale, q_doc=None, k_doc=None):
    o, oe, lse = _forward(q, k, v, e, causal, scale, q_doc, k_doc)
    return o, (oe if oe is not None else q.new_empty(0)), lse  # ops return tensors: empty stands for "no E"


@_fwd_op.register_fake
def _fwd_fake(q, k, v, e, causal, scale, q_doc=None, k_doc=None):
    b, h, t, _, _, dv, de, _, _ = _dims(q, k, v, e)
    oe = _empty_heads_first_view(q, b, h, t, de) if e is not None else q.new_empty(0)
    return _empty_heads_first_view(q, b, h, t, dv), oe, q.new_empty(b, h, t, dtype=torch.float32)


@torch.library.custom_op(
    "tapetrain::tape_attention_bwd",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? e, Tensor o, Tensor? oe, Tensor lse, Tensor? do, Tensor? doe, "
    "bool causal, float scale, bool[] needs, Tensor? q_doc=None, Tensor? k_doc=None) -> (Tensor, Tensor, Tensor, "
    "Tensor)",
)
def _bwd_op(q, k, v, e, o, oe, lse, do, doe, causal, scale, needs, q_doc=None, k_doc=None):
    grads = _backward_impl(q, k, v, e, o, oe, lse, do, doe, causal, scale, tuple(needs), q_doc, k_doc)[:4]
    return tuple(g if g is not None else q.new_empty(0) for g in grads)


@_bwd_op.register_fake
def _bwd_fake(q, k, v, e, o, oe, lse, do, doe, causal, scale, needs, q_doc=None, k_doc=None):
    b, h, t, s, d, dv, de, gk, gv = _dims(q, k, v, e)
    empty = q.new_empty(0)
    use_e = doe is not None and e is not None
    if do is None and not use_e:
        return empty, empty, empty, empty
    return (
        _empty_heads_first_view(q, b, h, t, d) if needs[0] else empty,
        _empty_heads_first_view(q, b, h // gk, s, d, k.dtype) if needs[1] else empty,
        _empty_heads_first_view(q, b, h // gv, s, dv, v.dtype) if needs[2] and do is not None else empty,
        _empty_heads_first_view(q, b, h, s, de, e.dtype) if needs[3] and use_e else empty,
    )


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, e, causal, scale, q_doc, k_doc = (*inputs, None, None)[:8]
    o, oe, lse = output
    ctx.save_for_backward(q, k, v, e, o, oe if e is not None else None, lse, q_doc, k_doc)
    ctx.causal, ctx.scale = causal, scale
    ctx.set_materialize_grads(False)  # a None upstream grad stays None: that stream's terms are skipped


def _autograd_backward(ctx, do, doe, _dlse):
    q, k, v, e, o, oe, lse, q_doc, k_doc = ctx.saved_tensors
    needs = [bool(x) for x in ctx.needs_input_grad[:4]]
    grads = _bwd_op(q, k, v, e, o, oe, lse, do, doe if e is not None else None, ctx.causal, ctx.scale, needs,
                    q_doc, k_doc)
    # an empty result stands for "no gradient" (not needed, or its stream had no upstream grad)
    inputs = (q, k, v, e)
    kept = [g if n and (g.numel() or not x.numel()) else None for g, n, x in zip(grads, needs, inputs, strict=True)]
    return (*kept, *[None] * (len(ctx.needs_input_grad) - 4))


torch.library.register_autograd("tapetrain::tape_attention_fwd", _autograd_backward, setup_context=_setup_context)


def tape_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    e: torch.Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused attention returning (A·V (B, H, T, Dv), A·E (B, H, T, De) or None); see the module docstring.
    q_doc (B, T), k_doc (B, S): document ids of queries and keys (packed documents), or None."""
    _check(q, k, v, e)
    if (q_doc is None) != (k_doc is None):
        raise ValueError("tape_attention takes document ids for both queries and keys, or neither")
    if q_doc is not None and (q_doc.shape != (q.shape[0], q.shape[2]) or k_doc.shape != (k.shape[0], k.shape[2])):
        raise ValueError(f"q_doc must be (B, T) and k_doc (B, S); got {tuple(q_doc.shape)}, {tuple(k_doc.shape)}")
    q, k, v, e = (_unit_last_stride(x) for x in (q, k, v, e))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if q_doc is None:
        o, oe, _ = _fwd_op(q, k, v, e, bool(causal), scale)
    else:
        q_doc, k_doc = q_doc.to(torch.int32).contiguous(), k_doc.to(torch.int32).contiguous()
        o, oe, _ = _fwd_op(q, k, v, e, bool(causal), scale, q_doc, k_doc)
    return o, (oe if e is not None else None)


# --------------------------------------------------------------------------------------------------------------
# Kernel report (tools/kernel_report.py)
# --------------------------------------------------------------------------------------------------------------

REPORT_HEAD_DIMS = (64, 128)
REPORT_SHAPE = (2, 16, 1024)  # B, H, T: a representative training shape


def report_launches(arch: int, dtype: torch.dtype) -> list[Launch]:
    """The launches of one causal forward + backward at each REPORT_HEAD_DIMS, TAPE (values V and E, Dv = De = D)
    and values only, on meta tensors in the layout the model uses (heads-first views of token-major memory), for
    compute capability `arch`; labelled head_dim and case ("tape" | "plain"). On Hopper the TAPE launches in 16-bit
    carry their HOPPER_CANDIDATES."""
    b, h, t = REPORT_SHAPE
    kind_of = {name: kind for kind, name in LAUNCH_NAMES.items()}
    records: list[Launch] = []
    for d in REPORT_HEAD_DIMS:
        for tape in (True, False):
            meta = torch.empty(0, device="meta", dtype=dtype)
            q, k, v, do = (_empty_heads_first_view(meta, b, h, t, d) for _ in range(4))
            e, doe = (_empty_heads_first_view(meta, b, h, t, d) for _ in range(2)) if tape else (None, None)
            scale = 1.0 / math.sqrt(d)
            with _launcher.capture(arch, head_dim=d, case="tape" if tape else "plain") as launches:
                o, oe, lse = _forward(q, k, v, e, True, scale)
                _backward_impl(q, k, v, e, o, oe, lse, do, doe, True, scale, (True, True, True, tape))
            if tape and _family(arch) == 90 and dtype != torch.float32:
                for launch in launches:
                    launch.candidates = list(HOPPER_CANDIDATES[kind_of[launch.name]])
            records += launches
    return records
