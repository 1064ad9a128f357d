"""tapetrain.kernels.flash4's adapters around flash-attn-4, on the CPU: layouts, the [V ‖ E] split and merge,
cu_seqlens from document ids, the two-call backward from one lse, the custom ops' fakes and autograd, and the
backend registration. flash-attn-4's calls are replaced by tests/unit/fa4_contract.py, a plain-torch reference of
their contract: these tests verify the adapters, never the kernel (tests/gpu/test_gpu_flash4.py does that)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tapetrain.kernels import flash4
from tapetrain.model import attention as attn
from tapetrain.model.config import ATTN_BACKENDS
from tapetrain.model.documents import DocumentMask
from tests.unit.fa4_contract import ReferenceFa4Calls

B, H, T, D = 2, 4, 24, 16
FA4 = list(attn.FA4_BACKENDS)
# (calls the adapter must make for one TAPE attention, forward then backward): (kind, D, Dv, packed)
EXPECTED_CALLS = {
    "fa4": [("fwd", D, D), ("fwd", D, D), ("bwd", D, D), ("bwd", D, D)],
    "fa4_wide": [("fwd", D, 2 * D), ("bwd", D, 2 * D)],
    "fa4_wide_fwd": [("fwd", D, 2 * D), ("bwd", D, D), ("bwd", D, D)],
    "fa4_padded": [("fwd", 2 * D, 2 * D), ("bwd", 2 * D, 2 * D)],
}


@pytest.fixture
def reference():
    calls = ReferenceFa4Calls()
    with flash4.using_calls(calls):
        yield calls


def _inputs(kv_heads: int, *, e: bool, seed: int = 0):
    """TAPE's shapes, token-major storage seen heads-first: q, k (B, H, T, D), v (B, Hv, T, D), e (B, H, T, D)."""
    g = torch.Generator().manual_seed(seed)

    def rand(heads):
        return torch.randn(B, T, heads, D, generator=g).to(torch.bfloat16).transpose(1, 2).requires_grad_(True)

    return rand(H), rand(H if e else kv_heads), rand(kv_heads), (rand(H) if e else None)


def _docs() -> DocumentMask:
    ids = torch.tensor([[0] * 7 + [1] * 12 + [2] * 5, [4] * 20 + [5] * 4])
    return DocumentMask.of(ids)


def _grads(outputs, inputs, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=g) for o in outputs]
    loss = sum((o.float() * c).sum() for o, c in zip(outputs, cot, strict=True))
    return torch.autograd.grad(loss, inputs)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert want.abs().max() > 0, f"{what}: the reference is zero"
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < 3e-2, f"{what}: relative error {err:.3g}"


@pytest.mark.parametrize("backend", FA4)
@pytest.mark.parametrize("docs", [False, True], ids=["plain", "docs"])
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
def test_tape_attention_matches_eager_forward_and_every_gradient(reference, backend, docs, kv_heads):
    q, k, v, e = _inputs(kv_heads, e=True)
    mask = _docs() if docs else None
    out, out_e = attn._IMPLS[backend](q, k, v, e, causal=True, docs=mask)
    leaves = [q, k, v, e]
    grads = _grads([out, out_e], leaves)
    ref_leaves = [x.detach().float().requires_grad_(True) for x in leaves]
    ref_out, ref_e = attn.eager_attention(*ref_leaves, causal=True, docs=mask)
    ref_grads = _grads([ref_out, ref_e], ref_leaves)
    _close(out, ref_out, "A·V")
    _close(out_e, ref_e, "A·E")
    for name, got, want in zip("qkve", grads, ref_grads, strict=True):
        _close(got, want, f"d{name}")
    assert [c[:3] for c in reference.calls] == EXPECTED_CALLS[backend]  # the strategy's calls, no others
    assert {c[3] for c in reference.calls} == {docs}  # packed (cu_seqlens) exactly when documents are


@pytest.mark.parametrize("backend", FA4)
@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
def test_without_e_every_fa4_backend_is_one_d_by_d_call_with_native_gqa(reference, backend, kv_heads):
    q, k, v, _ = _inputs(kv_heads, e=False)
    mask = _docs()
    out, none = attn._IMPLS[backend](q, k, v, causal=True, docs=mask)
    assert none is None
    grads = _grads([out], [q, k, v])
    ref_leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
    ref_out, _ = attn.eager_attention(*ref_leaves, causal=True, docs=mask)
    _close(out, ref_out, "A·V")
    for name, got, want in zip("qkv", grads, _grads([ref_out], ref_leaves), strict=True):
        _close(got, want, f"d{name}")
    assert [c[:3] for c in reference.calls] == [("fwd", D, D), ("bwd", D, D)]
    assert k.grad is None and grads[1].shape == k.shape  # dk for the Hk heads, not expanded ones


def test_split_backward_uses_the_forward_lse(reference):
    """fa4_wide_fwd's two backward calls must take the wide forward's lse: a wrong one changes every gradient."""
    q, k, v, e = _inputs(H, e=True)
    x = [t.transpose(1, 2).detach().contiguous() for t in (q, k, torch.cat([v, e], -1))]
    out, lse = flash4.fa4_fwd(*x, None, None, 0.25, True, D)
    dout = torch.randn_like(out)
    right = flash4.fa4_bwd(dout, *x, out, lse, None, None, 0.25, True, D)
    whole = flash4.fa4_bwd(dout, *x, out, lse, None, None, 0.25, True, 0)
    for a, b in zip(right, whole, strict=True):
        _close(a, b.float(), "split vs one backward")
    wrong = flash4.fa4_bwd(dout, *x, out, lse + 0.5, None, None, 0.25, True, D)
    assert (wrong[0].float() - right[0].float()).abs().max() > 1e-2


def test_lse_layout_round_trip_with_documents():
    packing = flash4._packing(*(lambda m: (m.q_ids, m.k_ids))(_docs()))
    lse = torch.randn(B, H, T)
    assert torch.equal(flash4._unpack_lse(flash4._pack_lse(lse, packing), B, packing), lse)
    assert flash4._pack_lse(lse, packing).shape == (H, B * T)
    assert packing.cu_q.tolist() == [0, 7, 19, 24, 44, 48] and packing.max_q == 20


def test_custom_ops_pass_opcheck(reference):
    """Schemas, fake (meta) functions and autograd registration as torch.library expects them."""
    gqa = [t.transpose(1, 2).detach().contiguous() for t in _inputs(2, e=False)[:3]]  # k, v with 2 heads
    mha = [t.transpose(1, 2).detach().contiguous() for t in _inputs(H, e=False)[:3]]
    ids = _docs().q_ids
    for x, q_ids, split in ((gqa, None, 0), (gqa, ids, 0), (mha, ids, 8)):  # split: sm90 wants D == Dv under GQA
        args = (*x, q_ids, q_ids, 0.25, True, split)
        torch.library.opcheck(flash4.fa4_fwd, args, test_utils=("test_schema", "test_faketensor",
                                                                "test_autograd_registration"))
        out, lse = flash4.fa4_fwd(*args)
        torch.library.opcheck(flash4.fa4_bwd, (torch.randn_like(out), *x, out, lse, q_ids, q_ids, 0.25, True, split),
                              test_utils=("test_schema", "test_faketensor"))


def test_the_fakes_give_the_layout_the_ops_return_for_strided_inputs(reference):
    """The model hands the ops token-major views of heads-first storage (strided, not contiguous). The ops return
    contiguous tensors, and their fakes must say so: on the H200 (2026-11-28) a compiled layer's backward failed
    Inductor's stride check because fa4_bwd's fake copied q's strides (`expected ... stride 512==64`)."""
    def strided(kv_heads):  # (B, T, H, D) views of (B, H, T, D) storage
        return [t.detach().contiguous().transpose(1, 2) for t in _inputs(kv_heads, e=False)[:3]]

    gqa, mha, ids = strided(2), strided(H), _docs().q_ids
    assert not gqa[0].is_contiguous()
    for args in ((*gqa, None, None, 0.25, True, 0), (*mha, ids, ids, 0.25, True, 8)):  # split: sm90 wants MHA
        torch.library.opcheck(flash4.fa4_fwd, args, test_utils=("test_faketensor",))
        out, lse = flash4.fa4_fwd(*args)
        dout = torch.randn(out.shape[0], out.shape[2], out.shape[1], out.shape[3]).to(out.dtype).transpose(1, 2)
        torch.library.opcheck(flash4.fa4_bwd, (dout, *args[:3], out, lse, *args[3:]), test_utils=("test_faketensor",))


@pytest.mark.parametrize("backend", ["fa4_wide_fwd"])  # its op carries the split backward; the others are plainer
def test_compiles_without_a_graph_break(reference, backend):
    q, k, v, e = _inputs(2, e=True)
    mask = _docs()

    def loss(q, k, v, e):
        out, out_e = attn._IMPLS[backend](q, k, v, e, causal=True, docs=mask)
        return out.float().square().sum() + out_e.float().sum()

    torch.compile(loss, backend="aot_eager", fullgraph=True)(q, k, v, e).backward()  # fullgraph: a break raises
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q, k, v, e))


def test_backends_are_registered_and_refuse_what_they_cannot_do(reference):
    assert set(attn.FA4_BACKENDS) <= set(ATTN_BACKENDS) and set(attn.FA4_BACKENDS) <= set(attn._IMPLS)
    assert not any(attn.backend_available(name, torch.device("cpu")) for name in attn.FA4_BACKENDS)
    q, k, v, e = _inputs(H, e=True)
    with pytest.raises(ValueError, match="model.attn_backend=sdpa"):
        attn._IMPLS["fa4"](q, k, v, e, bias=torch.zeros(1, H, T, T))
    with pytest.raises(ValueError, match="fp16/bf16"):
        flash4.fa4_tape_attention(q.float(), k.float(), v.float(), e.float())


def test_flash_attn_4_alone_does_not_make_flash_attn_2_available(tmp_path, monkeypatch):
    """flash-attn-4 installs flash_attn as a namespace package holding only `cute`: `import flash_attn` then works
    although flash-attn 2's functions are absent, and "flash" must not count as available."""
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("raise ImportError('CuTe DSL must stay lazy')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        monkeypatch.delitem(sys.modules, name)
    cuda = torch.device("cuda")
    assert not attn.backend_available("flash", cuda)
    assert all(attn.backend_available(name, cuda) for name in attn.FA4_BACKENDS)  # found, not imported


def test_importing_tapetrain_does_not_import_cute_dsl(tmp_path):
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("raise SystemExit('flash_attn.cute imported')\n")
    code = textwrap.dedent("""
        import sys, torch
        import tapetrain.model.attention as attn, tapetrain.kernels.flash4
        assert attn.backend_available("fa4", torch.device("cuda"))
        assert "flash_attn.cute" not in sys.modules
        print("lazy")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         env={"PYTHONPATH": f"{tmp_path}:{Path(__file__).parents[2]}", "PATH": ""})
    assert run.stdout.strip() == "lazy", run.stderr


def test_the_wide_backward_is_refused_on_hopper_with_the_backend_that_works(reference, monkeypatch):
    """On the H200 every fa4_wide training case failed at the backward's launch (shared memory 248832 > 232448
    bytes): on sm90 the backend refuses training by name and points to fa4_wide_fwd; inference is unaffected."""
    monkeypatch.setattr(flash4, "_capability", lambda device: 9)
    q, k, v, e = _inputs(H, e=True)
    with pytest.raises(ValueError, match="fa4_wide cannot train on Hopper.*use fa4_wide_fwd"):
        attn._IMPLS["fa4_wide"](q, k, v, e, causal=True)
    with torch.no_grad():
        out, out_e = attn._IMPLS["fa4_wide"](q, k, v, e, causal=True)
    assert out.shape == q.shape and out_e.shape == e.shape
    out, _ = attn._IMPLS["fa4_wide_fwd"](q, k, v, e, causal=True)
    out.float().sum().backward()
    monkeypatch.setattr(flash4, "_capability", lambda device: 10)  # not refused elsewhere (unmeasured there)
    attn._IMPLS["fa4_wide"](q, k, v, e, causal=True)[0].float().sum().backward()
