"""tapetrain.kernels.launch: the launcher every Triton kernel module shares, and the report_launches protocol.

The fallback tests launch a stand-in for a compiled kernel that refuses configs as the compiler would
(OutOfResources): the launcher's choice is the thing under test, the kernels themselves are tested in
test_kernel_*.py. The Hopper candidates of the attention kernel run for real in Triton's CPU interpreter.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from triton.runtime.errors import OutOfResources  # noqa: E402

from tapetrain.kernels import tape_attention, tape_head_mix, tape_mlp_update, tape_rotation  # noqa: E402
from tapetrain.kernels.launch import KernelLauncher, Launch, LaunchConfig  # noqa: E402
from tapetrain.model.attention import eager_attention  # noqa: E402

KERNELS = Path(tape_attention.__file__).parent
MODULES = (tape_attention, tape_mlp_update, tape_rotation, tape_head_mix)


class RefusingKernel:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` fails with OutOfResources for BLOCK_M > fits, as the
    compiler does for a config that needs too much shared memory; records the launches that ran."""

    def __init__(self, fits: int):
        self.fits = fits
        self.ran: list[tuple] = []

    def __getitem__(self, grid):
        def run(*args, BLOCK_M, num_warps, num_stages, **consts):
            if BLOCK_M > self.fits:
                raise OutOfResources(BLOCK_M * 1024, 1024, "shared memory")
            self.ran.append((grid, BLOCK_M, args, consts))

        return run


CONFIGS = [LaunchConfig.of(8, 3, BLOCK_M=128), LaunchConfig.of(4, 2, BLOCK_M=64), LaunchConfig.of(4, 1, BLOCK_M=32)]


def test_first_config_that_compiles_is_used_and_remembered_per_key():
    launcher = KernelLauncher("op", probe_kernel=None)
    kernel = RefusingKernel(fits=64)
    grid = lambda c: (1024 // c["BLOCK_M"],)  # noqa: E731
    launcher.launch(kernel, "k", grid, CONFIGS, ("x",), {"C": 1}, key=("a",))
    assert kernel.ran == [((16,), 64, ("x",), {"C": 1})]
    # the remembered config goes first for that key: no second refusal, the same config runs
    kernel.fits = 1 << 20
    launcher.launch(kernel, "k", grid, CONFIGS, ("x",), {"C": 1}, key=("a",))
    assert [r[1] for r in kernel.ran] == [64, 64]
    # another key (or no key) starts from the top
    launcher.launch(kernel, "k", grid, CONFIGS, ("x",), {"C": 1}, key=("b",))
    launcher.launch(kernel, "k", grid, CONFIGS, ("x",), {"C": 1})
    assert [r[1] for r in kernel.ran] == [64, 64, 128, 128]
    launcher.forget_chosen()
    kernel.fits = 32
    launcher.launch(kernel, "k", grid, CONFIGS, ("x",), {"C": 1}, key=("a",))
    assert kernel.ran[-1][1] == 32


def test_no_config_fits_names_the_kernel_and_the_configs():
    launcher = KernelLauncher("tape_x", probe_kernel=None)
    with pytest.raises(RuntimeError, match=r"tape_x: no launch config of _k fits this GPU.*'BLOCK_M': 32") as err:
        launcher.launch(RefusingKernel(fits=16), "_k", lambda c: (1,), CONFIGS, (), {})
    assert isinstance(err.value.__cause__, OutOfResources)


def test_empty_grid_launches_nothing():
    kernel = RefusingKernel(fits=1 << 20)
    KernelLauncher("op", probe_kernel=None).launch(kernel, "k", lambda c: (0, 4), CONFIGS, (), {})
    assert kernel.ran == []


def test_capture_records_instead_of_launching():
    launcher = KernelLauncher("op", probe_kernel=None)
    kernel = RefusingKernel(fits=1 << 20)
    with launcher.capture(90, shape="s") as launches:
        assert launcher.arch(torch.empty(0)) == 90
        launcher.launch(kernel, "k", lambda c: (1,), CONFIGS, ("x",), {"C": 1}, key=("a",))
        with pytest.raises(RuntimeError, match="already under way"):
            with launcher.capture(80):
                pass
    assert kernel.ran == []
    assert launches == [Launch("k", kernel, ("x",), {"C": 1}, CONFIGS, {"shape": "s"})]
    launcher.launch(kernel, "k", lambda c: (1,), CONFIGS, ("x",), {"C": 1})  # after the capture: runs
    assert len(kernel.ran) == 1


def _private_kernel_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tapetrain.kernels."):
            sibling = node.module.rsplit(".", 1)[-1] != "launch"
            found += [f"{node.module}.{a.name}" for a in node.names if sibling or a.name.startswith("_")]
    return found


def triton_kernel_modules() -> set[str]:
    """The modules under tapetrain/kernels that define @triton.jit kernels."""
    return {f"tapetrain.kernels.{p.stem}" for p in KERNELS.glob("*.py")
            if re.search(r"^@triton\.jit", p.read_text(), re.MULTILINE)}  # fmt: skip


def test_kernel_modules_share_only_the_launch_module():
    """The kernel modules once imported tape_attention's private helpers (_interpreting, _pad, ...): what they
    share lives in launch.py, and none imports another kernel module or a private name."""
    assert triton_kernel_modules() == {m.__name__ for m in MODULES}
    for module in MODULES:
        assert _private_kernel_imports(Path(module.__file__)) == [], module.__name__


def test_every_triton_kernel_module_is_in_the_kernel_report():
    """A new Triton kernel module gets its registers and spills reported and checked (tools/kernel_report.py reads
    the source, not imported here: the tool unsets TRITON_INTERPRET)."""
    tool = ast.parse((KERNELS.parents[1] / "tools" / "kernel_report.py").read_text())
    listed = next(ast.literal_eval(node.value) for node in tool.body if isinstance(node, ast.Assign)
                  and getattr(node.targets[0], "id", None) == "KERNEL_MODULES")  # fmt: skip
    assert set(listed) == triton_kernel_modules()


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_report_launches_protocol(module):
    """Every kernel module reports its launches the same way: Launch records on meta tensors, labelled, with the
    configs its runtime would try."""
    launches = module.report_launches(90, torch.bfloat16)
    assert launches and all(isinstance(r, Launch) for r in launches)
    for r in launches:
        assert r.configs and all(isinstance(c, LaunchConfig) for c in r.configs)
        assert r.labels and r.name.split(":")[0] == r.kernel.fn.__name__
        assert all(a.device.type == "meta" for a in r.args if isinstance(a, torch.Tensor))
    # the capture is over: the module launches for real again (its CPU tests pass in the same process)


def test_hopper_configs_on_compute_capability_9(monkeypatch):
    """The Hopper rows (ptxas for sm_90a, timed on the H100) on 9.x; sm_80's rows elsewhere, Blackwell (10.x,
    12.x) included, where neither was measured."""
    monkeypatch.setattr(tape_attention, "interpreting", lambda: False)  # the GPU's table, not the interpreter's tiles
    rows = tape_attention._TABLE
    for arch, family in ((90, 90), (80, 80), (86, 80), (89, 80), (100, 80), (120, 80)):
        got = tape_attention._configs("fwd", arch, 128, torch.bfloat16)[0]
        assert got == tape_attention._config(*rows[family, "fwd", 128][0]), arch


def test_hopper_candidates_start_with_the_runtime_choices():
    """tools/tune_attention.py times the candidates in order within a budget: today's choices first, the baseline
    any other candidate has to beat."""
    for kind, candidates in tape_attention.HOPPER_CANDIDATES.items():
        chosen = list(dict.fromkeys(tape_attention._config(*rows[0]) for (family, k, _), rows
                                    in tape_attention._TABLE.items() if family == 90 and k == kind))  # fmt: skip
        assert chosen and candidates[: len(chosen)] == chosen, kind
        assert len(set(candidates)) == len(candidates) > len(chosen)


def test_hopper_candidates_in_the_attention_report():
    launches = tape_attention.report_launches(90, torch.bfloat16)
    tape = [r for r in launches if r.labels["case"] == "tape"]
    assert tape and all(r.candidates for r in tape)
    assert not any(r.candidates for r in launches if r.labels["case"] == "plain")
    assert not any(r.candidates for r in tape_attention.report_launches(80, torch.bfloat16))


BLOCK_SHAPES = sorted({(c["BLOCK_M"], c["BLOCK_N"]) for cs in tape_attention.HOPPER_CANDIDATES.values() for c in cs})


@pytest.mark.parametrize("block_m,block_n", BLOCK_SHAPES)
def test_hopper_candidate_tiles_are_exact(monkeypatch, block_m, block_n):
    """Every tile shape of the Hopper candidates, forced on all four kernels (de in its own pass), against the
    eager fp32 reference: T = 136 covers several tiles and a partial one. (Warps and stages do not change what the
    interpreter computes; on a GPU tools/tune_attention.py times them.)"""
    monkeypatch.setattr(tape_attention, "_split_de", lambda *args: True)
    for kind in tape_attention.LAUNCH_NAMES:
        tape_attention.force_config(kind, (block_m, block_n, 4, 2))
    try:
        gen = torch.Generator().manual_seed(0)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        q, k, v, e = (torch.randn(1, 1, 136, 16, generator=gen).to(dev).requires_grad_() for _ in range(4))
        go, goe = torch.randn(2, 1, 1, 136, 16, generator=gen).to(dev)
        outs = tape_attention.tape_attention(q, k, v, e, causal=True)
        grads = torch.autograd.grad((outs[0] * go).sum() + (outs[1] * goe).sum(), (q, k, v, e))
        ref = eager_attention(q, k, v, e, causal=True)
        ref_grads = torch.autograd.grad((ref[0] * go).sum() + (ref[1] * goe).sum(), (q, k, v, e))
    finally:
        for kind in tape_attention.LAUNCH_NAMES:
            tape_attention.force_config(kind, None)
    for got, want in zip((*outs, *grads), (*ref, *ref_grads), strict=True):
        assert want.abs().max() > 0
        assert (got - want).abs().max() < 1e-4
