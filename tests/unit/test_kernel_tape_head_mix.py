"""Fused TAPE head mix with the residual (tapetrain.kernels.tape_head_mix) against TapeHeadMix.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is imported) on
tiny shapes with 4-token chunks, so several programs (and their d_W partials) and a partial chunk are exercised.
The bf16 test is marked `gpu`.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from tapetrain.kernels import tape_head_mix as kernel_mod  # noqa: E402
from tapetrain.kernels.tape_head_mix import tape_head_mix  # noqa: E402
from tapetrain.model.tape import TapeHeadMix  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def _module(m: int, mode: str, seed: int = 2) -> TapeHeadMix:
    """TapeHeadMix with a random weight: its zero init would make every attended/weight gradient trivial."""
    mix = TapeHeadMix(m, mode).to(DEV)
    with torch.no_grad():
        mix.weight.copy_(torch.randn(mix.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return mix


def _inputs(b, t, m, d, dtype=torch.float32, seed=0):
    """state (B, T, M, D) and attended as the model has it: a token-major view of heads-first (B, M, T, D)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    state = torch.randn(b, t, m, d, generator=gen, device=DEV).to(dtype).requires_grad_()
    heads_first = torch.randn(b, m, t, d, generator=gen, device=DEV).to(dtype).requires_grad_()
    return state, heads_first.transpose(1, 2), heads_first


def _run(fn, state, attended, leaves, grad):
    out = fn(state, attended)
    return out, torch.autograd.grad((out.float() * grad).sum(), leaves)


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("mode", ["full", "gain"])
@pytest.mark.parametrize(
    "shape", [(2, 11, 4, 16), (1, 9, 3, 20), (1, 4, 16, 16)], ids=lambda s: "B{}T{}M{}D{}".format(*s)
)
def test_matches_eager_fp32(mode, shape):
    """Odd T over several 4-token chunks; M, D padded to 16 (3, 20) or exact (16, 16); non-contiguous attended."""
    b, t, m, d = shape
    mix = _module(m, mode)
    state, attended, heads_first = _inputs(b, t, m, d)
    assert not attended.is_contiguous()
    grad = torch.randn(b, t, m, d, device=DEV)
    leaves = [state, heads_first, mix.weight]
    out, grads = _run(lambda s, a: tape_head_mix(s, a, mix.weight), state, attended, leaves, grad)
    ref, ref_grads = _run(mix, state, attended, leaves, grad)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert _rel_err(out, ref) < 1e-5
    for name, g, r in zip(("state", "attended", "weight"), grads, ref_grads, strict=True):
        assert r.abs().max() > 0, f"reference d{name} is all zero: the comparison would compare nothing"
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert _rel_err(g, r) < 1e-5, (name, _rel_err(g, r))


@pytest.mark.parametrize("mode", ["full", "gain"])
def test_several_d_blocks(monkeypatch, mode):
    """D split over grid programs (what M = 32, D = 128 gets on GPU), here 16-column blocks, the last partial."""
    monkeypatch.setattr(kernel_mod, "TILE", 256)
    b, t, m, d = 1, 6, 16, 40
    assert kernel_mod._grid(torch.empty(b, t, m, d, device="meta"))[1] == 3
    mix = _module(m, mode)
    state, attended, heads_first = _inputs(b, t, m, d)
    grad = torch.randn(b, t, m, d, device=DEV)
    leaves = [state, heads_first, mix.weight]
    out, grads = _run(lambda s, a: tape_head_mix(s, a, mix.weight), state, attended, leaves, grad)
    ref, ref_grads = _run(mix, state, attended, leaves, grad)
    assert _rel_err(out, ref) < 1e-5
    for g, r in zip(grads, ref_grads, strict=True):
        assert _rel_err(g, r) < 1e-5


@pytest.mark.parametrize("mode", ["full", "gain"])
def test_strided_everything(mode):
    """A strided state, a transposed weight and a stride-0 upstream grad give the same results as copies."""
    b, t, m, d = 2, 7, 4, 16
    mix = _module(m, mode)
    weight = mix.weight.detach().t().contiguous().t().requires_grad_() if mode == "full" else mix.weight
    state = torch.randn(b, t, 2 * m, d, device=DEV)[:, :, ::2].requires_grad_()
    _, attended, heads_first = _inputs(b, t, m, d)
    grad = torch.randn(1, t, m, 1, device=DEV).expand(b, t, m, d)
    leaves = [state, heads_first, weight]
    out, grads = _run(lambda s, a: tape_head_mix(s, a, weight), state, attended, leaves, grad)
    ref, ref_grads = _run(mix, state, attended, leaves[:2] + [mix.weight], grad)
    assert _rel_err(out, ref) < 1e-5
    for g, r in zip(grads, ref_grads, strict=True):
        assert _rel_err(g, r) < 1e-5


def test_fp16_interpreter_smoke():
    m = 4
    mix = _module(m, "full")
    state, attended, heads_first = _inputs(1, 6, m, 16, dtype=torch.float16)
    grad = torch.randn(1, 6, m, 16, device=DEV)
    out, grads = _run(lambda s, a: tape_head_mix(s, a, mix.weight), state, attended, [state, heads_first, mix.weight],
                      grad)  # fmt: skip
    s32, h32 = state.detach().float().requires_grad_(), heads_first.detach().float().requires_grad_()
    ref, ref_grads = _run(mix, s32, h32.transpose(1, 2), [s32, h32, mix.weight], grad)
    assert out.dtype == torch.float16 and grads[1].dtype == torch.float16 and grads[2].dtype == torch.float32
    assert _rel_err(out, ref) < 5e-3
    for g, r in zip(grads, ref_grads, strict=True):
        assert _rel_err(g, r) < 5e-3


def test_no_graph_break():
    mix = _module(4, "full")
    state, attended, _ = _inputs(1, 5, 4, 16)

    def fn(state, attended, weight):
        return tape_head_mix(state, attended, weight).sum()

    explained = torch._dynamo.explain(fn)(state, attended, mix.weight)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.parametrize("mode", ["full", "gain"])
def test_opcheck(mode):
    """torch.library's checks of the op's schema, fake (meta) function and autograd registration."""
    m = 3
    state, attended, _ = _inputs(1, 5, m, 16)
    weight = torch.randn((m, m) if mode == "full" else (m,), device=DEV).requires_grad_()
    torch.library.opcheck(kernel_mod._fwd_op, (state, attended, weight))


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for the backward while fn runs."""
    storages: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("mode", ["full", "gain"])
def test_saved_bytes(mode):
    """Eager and fused both save attended (M·D elements per token) and the weight (M² or M): the fusion saves
    no extra activation (the state's gradient is dout itself)."""
    b, t, m, d = 1, 8, 4, 16
    mix = _module(m, mode)
    state, attended, _ = _inputs(b, t, m, d)
    expected = 4 * (b * t * m * d + mix.weight.numel())
    assert _saved_bytes(lambda: mix(state, attended)) == expected
    assert _saved_bytes(lambda: tape_head_mix(state, attended, mix.weight)) == expected


def test_input_validation(monkeypatch):
    state, attended, _ = _inputs(1, 4, 4, 16)
    with pytest.raises(ValueError, match="weight"):
        tape_head_mix(state, attended, torch.zeros(3, 3, device=DEV))
    with pytest.raises(ValueError, match="share"):
        tape_head_mix(state, attended.double(), torch.zeros(4, device=DEV))
    if not CUDA:
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            tape_head_mix(state, attended, torch.zeros(4))


def test_report_launches_records():
    records = kernel_mod.report_launches(80, torch.bfloat16)
    assert [r.name for r in records] == ["_mix_fwd_kernel", "_mix_bwd_kernel"] * 2 * len(kernel_mod.REPORT_SHAPES)
    for r in records:
        (config,) = r.configs
        assert r.consts["BLOCK_M"] * config["BLOCK_D"] <= kernel_mod.TILE and r.args[0].device.type == "meta"
        assert "shape" in r.labels


# ----------------------------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.verifies(kind="tape_update", backend="triton", dtypes=["bf16"])
@pytest.mark.parametrize("mode", ["full", "gain"])
@pytest.mark.parametrize("m", [16, 32])
def test_gpu_bf16_matches_eager(mode, m):
    """bf16 kernel vs an fp32 reference, within twice eager bf16's own error (plus a small floor)."""
    b, t, d = 2, 1000, 128
    mix = _module(m, mode)
    state, attended, heads_first = _inputs(b, t, m, d, dtype=torch.bfloat16)
    grad = torch.randn(b, t, m, d, device=DEV)

    def leaves(dtype):
        s, h = state.detach().to(dtype).requires_grad_(), heads_first.detach().to(dtype).requires_grad_()
        return s, h.transpose(1, 2), [s, h, mix.weight]

    s, a, ls = leaves(torch.bfloat16)
    got = _run(lambda s, a: tape_head_mix(s, a, mix.weight), s, a, ls, grad)
    ref = _run(mix, *leaves(torch.float32), grad)
    base = _run(mix, *leaves(torch.bfloat16), grad)
    for a, r, bl in zip([got[0], *got[1]], [ref[0], *ref[1]], [base[0], *base[1]], strict=True):
        assert r.abs().max() > 0
        err, base_err = (a.float() - r).abs().max().item(), (bl.float() - r).abs().max().item()
        assert err <= 2 * base_err + 1e-3 * r.abs().max().item()
