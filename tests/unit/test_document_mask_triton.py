"""The Triton kernel with packed documents (per-token ids), exact against eager, forward and backward.

Without CUDA it runs in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is imported) with 16×16
tiles: documents that start and end inside tiles and whole key tiles outside a query tile's documents (skipped
by the loop bounds) are both exercised.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from tapetrain.kernels.tape_attention import tape_attention  # noqa: E402
from tapetrain.model.attention import eager_attention  # noqa: E402
from tapetrain.model.documents import DocumentMask  # noqa: E402
from tests.unit.model_helpers import assert_reference_grads_nonzero  # noqa: E402
from tests.unit.test_document_mask import (  # noqa: E402
    LAYOUTS,
    make_model,
    packed_batch,
    run_packed,
    run_separately,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(torch.int32)


@pytest.mark.verifies
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_e", [True, False])
def test_kernel_matches_eager_with_documents(causal: bool, with_e: bool, verifies):
    verifies(kind="attention", backend="triton", dtypes=["fp32"], e=with_e, docs=True, gqa=True)
    # 56 tokens = 4 query tiles of 16; row 0: a 40-token document spanning tiles, then short ones; row 1 other cuts
    docs = torch.stack([_ids([40, 3, 13]), _ids([5, 11, 16, 24])]).to(DEV)
    gen = torch.Generator(device=DEV).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=DEV).requires_grad_()

    q, k, v = rnd(2, 4, 56, 16), rnd(2, 2, 56, 16), rnd(2, 1, 56, 16)  # GQA: H = 4, Hk = 2, Hv = 1
    e = rnd(2, 4, 56, 16) if with_e else None
    mask = DocumentMask.of(docs)
    go, goe = torch.randn(2, 4, 56, 16, device=DEV), torch.randn(2, 4, 56, 16, device=DEV)
    leaves = [q, k, v] + ([e] if with_e else [])

    def run(fn, **kw):
        o, oe = fn(q, k, v, e, causal=causal, **kw)
        loss = (o * go).sum() + ((oe * goe).sum() if with_e else 0)
        return [o, oe] if with_e else [o], torch.autograd.grad(loss, leaves)

    outs, grads = run(tape_attention, q_doc=mask.q_ids, k_doc=mask.k_ids)
    ref_outs, ref_grads = run(eager_attention, docs=mask)
    for a, b in zip(outs + list(grads), ref_outs + list(ref_grads), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.verifies(kind="attention", backend="triton", dtypes=["fp32"], e=True, docs=True, gqa=False)
def test_kernel_decode_alignment_with_documents():
    """T < S (a query block of xPos): queries are the last T keys, bottom-right aligned."""
    docs = torch.stack([_ids([20, 12]), _ids([9, 23])]).to(DEV)
    mask = DocumentMask.of(docs).slice(16, 32, 32)
    gen = torch.Generator(device=DEV).manual_seed(1)
    q, k, v, e = (torch.randn(2, 2, n, 16, generator=gen, device=DEV) for n in (16, 32, 32, 32))
    got = tape_attention(q, k, v, e, q_doc=mask.q_ids, k_doc=mask.k_ids)
    ref = eager_attention(q, k, v, e, docs=mask)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("pe", ["tape", "rope", "nope", "xpos"])
def test_packed_documents_equal_separate_runs_triton(pe: str):
    """The model on the Triton kernel (interpreter): logits, loss and gradients of the packed batch are those of
    the documents run alone (which use no mask)."""
    model = make_model(pe, "triton").to(DEV).train()  # on CUDA the kernel runs natively (fp32, no TF32)
    ids, labels, docs = (x.to(DEV) for x in packed_batch())
    assert [len(row) for row in LAYOUTS] == [3, 2]
    logits, loss, g = run_packed(model, ids, labels, docs)
    ref_logits, ref_loss, ref_g = run_separately(model, ids, labels)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=0)
    assert g.keys() == ref_g.keys()
    assert_reference_grads_nonzero(ref_g, list(ref_g))
    for name in g:
        torch.testing.assert_close(g[name], ref_g[name], atol=1e-5, rtol=0, msg=name)


def test_cu_seqlens_of_rows_and_documents():
    from tapetrain.kernels.flash import cu_seqlens

    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [3, 3, 4, 4, 4, 4]])
    cu_q, cu_k, max_q, max_k = cu_seqlens(ids, ids)
    assert cu_q.tolist() == cu_k.tolist() == [0, 3, 5, 6, 8, 12] and max_q == max_k == 4
    cu_q, cu_k, max_q, _ = cu_seqlens(ids[:, 4:], ids)  # a query block: documents without queries have length 0
    assert cu_q.tolist() == [0, 0, 1, 2, 2, 4] and cu_k.tolist() == [0, 3, 5, 6, 8, 12] and max_q == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("with_e", [True, False])
def test_flash_varlen_matches_eager_with_documents(with_e: bool, verifies):
    verifies(kind="attention", backend="flash", dtypes=["bf16"], e=with_e, docs=True, gqa=True)
    pytest.importorskip("flash_attn.flash_attn_interface")  # flash-attn 2 (4 alone: a namespace)
    from tapetrain.kernels.flash import flash_tape_attention

    docs = DocumentMask.of(torch.stack([_ids([300, 40, 172]), _ids([100, 412])]).cuda())
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, e = (torch.randn(2, 4, 512, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    e = e if with_e else None
    got = flash_tape_attention(q, k[:, :2], v[:, :2], e, docs=docs)
    ref = eager_attention(q.float(), k[:, :2].float(), v[:, :2].float(), None if e is None else e.float(), docs=docs)
    torch.testing.assert_close(got[0].float(), ref[0], atol=2e-2, rtol=0)
    if with_e:
        torch.testing.assert_close(got[1].float(), ref[1], atol=2e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention has no CPU backward)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_e", [True, False])
def test_flex_gradients_match_eager_with_documents(dtype: torch.dtype, with_e: bool, verifies):
    """fp32: within 1e-4 of eager. bf16: at most twice eager-bf16's own error against eager fp32."""
    from tapetrain.model.flex import flex_document_attention
    from tapetrain.model.kernel_record import DTYPE_NAMES

    verifies(kind="attention", backend="flex", dtypes=[DTYPE_NAMES[dtype]], e=with_e, docs=True, gqa=False)
    docs = DocumentMask.of(torch.stack([_ids([300, 40, 172]), _ids([100, 412])]).cuda())
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(2, 4, 512, 64, generator=gen, device="cuda") for _ in range(4 if with_e else 3)]

    def run(fn, leaves):
        leaves = [x.detach().clone().requires_grad_() for x in leaves]
        o, oe = fn(*leaves, docs=docs) if with_e else fn(*leaves, None, docs=docs)
        loss = o.float().square().sum() + (oe.float().sum() if with_e else 0)
        return [o, *([oe] if with_e else []), *torch.autograd.grad(loss, leaves)]

    got = run(flex_document_attention, [x.to(dtype) for x in base])
    ref = run(eager_attention, base)
    assert all(r.abs().max() > 0 for r in ref)  # a zero reference would compare nothing
    if dtype == torch.float32:
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        return
    eager_half = run(eager_attention, [x.to(dtype) for x in base])
    for a, r, bl in zip(got, ref, eager_half, strict=True):
        err, base_err = (a.float() - r).abs().max().item(), (bl.float() - r).abs().max().item()
        assert err <= 2 * base_err + 1e-3 * max(1.0, r.abs().max().item()), (err, base_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU interpreter's bf16 tl.dot is wrong)")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("gqa", [True, False])
def test_kernel_with_documents_in_bf16_is_as_close_as_eager_bf16(d: int, gqa: bool, verifies):
    """The document path in bf16 on the GPU's native tiles: its error against eager in fp32 is at most twice the
    error of eager itself run in bf16 (forward and every gradient), with documents that cut through 128-token tiles."""
    verifies(kind="attention", backend="triton", dtypes=["bf16"], e=True, docs=True, gqa=gqa)
    docs = DocumentMask.of(torch.stack([_ids([700, 40, 284]), _ids([100, 412, 1, 511])]).cuda())
    gen = torch.Generator(device="cuda").manual_seed(0)
    lo = [torch.randn(2, 4, 1024, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    if gqa:
        lo[1], lo[2] = lo[1][:, :2], lo[2][:, :2]  # 4 query heads, 2 key/value heads
    go, goe = (torch.randn(2, 4, 1024, d, generator=gen, device="cuda") for _ in range(2))

    def run(fn, leaves, **kw):
        leaves = [x.detach().clone().requires_grad_() for x in leaves]
        o, oe = fn(*leaves, **kw)
        loss = (o.float() * go).sum() + (oe.float() * goe).sum()
        return [o, oe, *torch.autograd.grad(loss, leaves)]

    got = run(tape_attention, lo, q_doc=docs.q_ids, k_doc=docs.k_ids)
    ref = run(eager_attention, [x.float() for x in lo], docs=docs)
    assert all(r.abs().max() > 0 for r in ref)  # a zero reference would compare nothing
    base = run(eager_attention, lo, docs=docs)
    for a, r, bl in zip(got, ref, base, strict=True):
        assert a.dtype == torch.bfloat16
        err, base_err = (a.float() - r).abs().max().item(), (bl.float() - r).abs().max().item()
        assert err <= 2 * base_err + 1e-3 * max(1.0, r.abs().max().item()), (err, base_err)
