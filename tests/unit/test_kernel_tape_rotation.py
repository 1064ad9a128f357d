"""Fused rotation of q and k by TAPE's state (tapetrain.kernels.tape_rotation) against the eager code.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is imported) on
tiny shapes with 8-token tiles, so several tiles and a partial one are exercised. The bf16 test is marked `gpu`.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from tapetrain.kernels import tape_rotation as kernel_mod  # noqa: E402
from tapetrain.kernels.tape_rotation import tape_rotate_qk  # noqa: E402
from tapetrain.model.tape import rotate_by_state  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def eager_rotate_qk(q: torch.Tensor, k: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What Attention.forward does: keys expanded to the query heads, then both rotated by E."""
    groups = q.shape[2] // k.shape[2]
    return rotate_by_state(q, state), rotate_by_state(k.repeat_interleave(groups, dim=2) if groups > 1 else k, state)


def _leaves(b, t, h, hkv, d, dtype=torch.float32, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=DEV).to(dtype).requires_grad_()

    return rnd(b, t, h, d), rnd(b, t, hkv, d), rnd(b, t, h, d)


def _run(fn, q, k, state, gq, gk):
    """Outputs and grads (q, k, state) of sum(q̃·gq) + sum(k̃·gk); a None upstream grad leaves that output out."""
    q_rot, k_rot = fn(q, k, state)
    loss = sum((out.float() * g).sum() for out, g in ((q_rot, gq), (k_rot, gk)) if g is not None)
    return (q_rot, k_rot), torch.autograd.grad(loss, [q, k, state], allow_unused=True)


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _compare(q, k, state, gq, gk, *, tol=1e-5):
    refs = [x.detach().contiguous().requires_grad_() for x in (q, k, state)]  # eager on plain copies
    (q_rot, k_rot), grads = _run(tape_rotate_qk, q, k, state, gq, gk)
    (ref_q, ref_k), ref_grads = _run(eager_rotate_qk, *refs, gq, gk)
    assert q_rot.shape == ref_q.shape == k_rot.shape and q_rot.dtype == q.dtype
    assert _rel_err(q_rot, ref_q) < tol and _rel_err(k_rot, ref_k) < tol
    for name, g, ref in zip(("q", "k", "state"), grads, ref_grads, strict=True):
        if ref is None:  # that input does not reach the loss (k with no upstream grad on k̃)
            assert g is None, name
            continue
        assert ref.abs().max() > 0, f"reference d{name} is all zero: the comparison would compare nothing"
        assert g.shape == ref.shape and g.dtype == ref.dtype, name
        assert _rel_err(g, ref) < tol, (name, _rel_err(g, ref))


def _upstream(b, t, h, d, seed=1):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(b, t, h, d, generator=gen, device=DEV), torch.randn(b, t, h, d, generator=gen, device=DEV)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("d", [16, 24], ids=["D16", "D24"])  # D = 24: F = 12 padded to 16 and masked
def test_matches_eager_fp32(heads, d):
    h, hkv = heads
    b, t = 2, 19  # odd T: two full 8-token tiles and a partial one
    _compare(*_leaves(b, t, h, hkv, d), *_upstream(b, t, h, d))


def test_model_views_and_strided_grads():
    """q and k as the model makes them (`.view`s of projection outputs, here slices of one fused qkv product),
    E a token-major view of heads-first memory, upstream grads transposed views and a stride-0 expand."""
    b, t, h, hkv, d = 2, 11, 4, 2, 16
    qkv = torch.randn(b, t, (h + 2 * hkv) * d, device=DEV)
    q = qkv[..., : h * d].view(b, t, h, d).detach().requires_grad_()  # non-contiguous views of leaves
    k = qkv[..., h * d : (h + hkv) * d].view(b, t, hkv, d).detach().requires_grad_()
    state_hf = torch.randn(b, h, t, d, device=DEV).requires_grad_()
    state = state_hf.transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous() and not state.is_contiguous()
    gq = torch.randn(b, h, t, d, device=DEV).transpose(1, 2)
    gk = torch.randn(1, t, 1, d, device=DEV).expand(b, t, h, d)
    _compare(q, k, state, gq, gk)


@pytest.mark.parametrize("used", ["q", "k"])
def test_one_output_used(used):
    """Only q̃ (or only k̃) reaches the loss: the other stream's terms are dropped, k gets no gradient without k̃."""
    b, t, h, hkv, d = 1, 9, 4, 2, 16
    gq, gk = _upstream(b, t, h, d)
    _compare(*_leaves(b, t, h, hkv, d), gq if used == "q" else None, gk if used == "k" else None)


@pytest.mark.parametrize("frozen", ["state", "q", "k", "q+k"])
def test_inputs_without_grad(frozen):
    """An input that needs no gradient gets none (layer 0's E^(0) is computed from positions); the others match."""
    b, t, h, hkv, d = 1, 9, 4, 2, 16
    q, k, state = _leaves(b, t, h, hkv, d)
    gq, gk = _upstream(b, t, h, d)
    frozen_set = set(frozen.split("+"))
    inputs = [
        x.detach() if name in frozen_set else x for name, x in zip("q k state".split(), (q, k, state), strict=True)
    ]
    wanted = [x for x in inputs if x.requires_grad]
    q_rot, k_rot = tape_rotate_qk(*inputs)
    grads = torch.autograd.grad((q_rot * gq).sum() + (k_rot * gk).sum(), wanted)
    ref_q, ref_k = eager_rotate_qk(*inputs)
    ref_grads = torch.autograd.grad((ref_q * gq).sum() + (ref_k * gk).sum(), wanted)
    for g, ref in zip(grads, ref_grads, strict=True):
        assert _rel_err(g, ref) < 1e-5


def test_fp16_interpreter_smoke():
    q, k, state = _leaves(1, 9, 4, 2, 16, dtype=torch.float16)
    gq, gk = _upstream(1, 9, 4, 16)
    (q_rot, k_rot), grads = _run(tape_rotate_qk, q, k, state, gq, gk)
    ref32 = [x.detach().float().requires_grad_() for x in (q, k, state)]
    (ref_q, ref_k), ref_grads = _run(eager_rotate_qk, *ref32, gq, gk)
    assert q_rot.dtype == torch.float16 and grads[1].dtype == torch.float16
    assert _rel_err(q_rot, ref_q) < 2e-3 and _rel_err(k_rot, ref_k) < 2e-3
    for g, ref in zip(grads, ref_grads, strict=True):
        assert _rel_err(g, ref) < 2e-3


def test_no_graph_break():
    q, k, state = _leaves(1, 5, 4, 2, 16)

    def fn(q, k, state):
        q_rot, k_rot = tape_rotate_qk(q, k, state)
        return (q_rot * k_rot).sum()

    explained = torch._dynamo.explain(fn)(q, k, state)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_opcheck():
    """torch.library's checks of the op's schema, fake (meta) function and autograd registration."""
    torch.library.opcheck(kernel_mod._fwd_op, _leaves(1, 5, 4, 2, 16))


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for the backward while fn runs."""
    storages: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "mqa"])
def test_saved_bytes(heads):
    """Per token: eager saves q, E and the expanded k, 3·H·D elements; the fused op q, E and k, (2·H + Hkv)·D."""
    h, hkv = heads
    b, t, d = 1, 8, 16
    q, k, state = _leaves(b, t, h, hkv, d)
    per_token = 4 * d  # fp32 bytes per head row
    assert _saved_bytes(lambda: eager_rotate_qk(q, k, state)) == b * t * 3 * h * per_token
    assert _saved_bytes(lambda: tape_rotate_qk(q, k, state)) == b * t * (2 * h + hkv) * per_token


def test_input_validation(monkeypatch):
    q, k, state = _leaves(1, 4, 3, 2, 16)  # Hkv = 2 does not divide H = 3
    with pytest.raises(ValueError, match="divide"):
        tape_rotate_qk(q, k, state)
    q, k, state = _leaves(1, 4, 2, 2, 16)
    with pytest.raises(ValueError, match="share"):
        tape_rotate_qk(q, k.double(), state)
    if not CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            tape_rotate_qk(q, k, state)


def test_report_launches_records():
    """One forward and one backward launch per report shape, in the form ptx_report.compile_ptx takes (the
    ptxas figures themselves need triton's compiler, not the interpreter: tools/kernel_report.py)."""
    records = kernel_mod.report_launches(90, torch.bfloat16)
    names = ["_rotate_fwd_kernel", "_rotate_bwd_kernel", "_rotate_bwd_kernel"] * len(kernel_mod.REPORT_SHAPES)
    assert [r.name for r in records] == names
    assert len({r.labels["shape"] for r in records}) == 2 * len(kernel_mod.REPORT_SHAPES)  # layer 0's apart
    for r in records:
        assert r.consts["BLOCK_F"] == 64 and all(t.device.type == "meta" for t in r.args[:5])
        assert r.configs == [kernel_mod._config("fwd" if r.name == "_rotate_fwd_kernel" else "bwd")]
    # the capture ended: a launch runs again
    q, k, state = (x.detach() for x in _leaves(1, 5, 4, 2, 16))
    assert tape_rotate_qk(q, k, state)[0].abs().sum() > 0


# ----------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.verifies(kind="tape_update", backend="triton", dtypes=["bf16"])
@pytest.mark.parametrize("heads", [(16, 16), (32, 8)], ids=["mha", "gqa4"])
def test_gpu_bf16_matches_eager(heads):
    """bf16 kernel vs an fp32 reference, within twice eager bf16's own error (plus a small floor)."""
    h, hkv = heads
    b, t, d = 2, 1000, 128
    lo = _leaves(b, t, h, hkv, d, dtype=torch.bfloat16)
    gq, gk = _upstream(b, t, h, d)
    got = _run(tape_rotate_qk, *lo, gq, gk)
    ref = _run(eager_rotate_qk, *[x.detach().float().requires_grad_() for x in lo], gq, gk)
    base = _run(eager_rotate_qk, *[x.detach().clone().requires_grad_() for x in lo], gq, gk)
    for a, r, bl in zip([*got[0], *got[1]], [*ref[0], *ref[1]], [*base[0], *base[1]], strict=True):
        assert a.dtype == torch.bfloat16 and r.abs().max() > 0
        err, base_err = (a.float() - r).abs().max().item(), (bl.float() - r).abs().max().item()
        assert err <= 2 * base_err + 1e-3 * r.abs().max().item()
