"""Register, spill and shared-memory figures of a Triton kernel for a GPU architecture, without that GPU.

A kernel is compiled for `GPUTarget("cuda", arch, 32)` with the specialisation the runtime would give the same
arguments (16-byte aligned pointers, strides divisible by 16, unit strides as constants), then the PTX goes
through the `ptxas` that ships in the triton wheel with `-v`, whose report gives registers per thread and spill
bytes. Shared memory comes from the compiled kernel's metadata (Triton allocates it dynamically).

This uses Triton's compiler internals (binder, `_pack_args`, `ASTSource`); it is tested against the installed
triton and fails with a clear message on a version whose internals moved.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

# Per-block shared memory (bytes) a kernel may use: A100 (sm_80) 163 KB opt-in, H100 (sm_90) 227 KB opt-in.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
PTXAS_NAME = {80: "sm_80", 90: "sm_90a"}


@dataclass
class KernelResources:
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_frame_bytes: int
    shared_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def find_ptxas() -> list[Path]:
    """ptxas binaries of the installed triton wheel (and TRITON_PTXAS_PATH), newest-PTX-capable last."""
    import triton

    found: list[Path] = []
    env = os.environ.get("TRITON_PTXAS_PATH")
    if env and Path(env).is_file():
        found.append(Path(env))
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    found += [p for p in (bin_dir / "ptxas", bin_dir / "ptxas-blackwell") if p.is_file()]
    return found


def compile_ptx(kernel, args: tuple, consts: dict, arch: int, num_warps: int, num_stages: int) -> tuple[str, int]:
    """(PTX text, dynamic shared-memory bytes) of `kernel` specialised for `args` on compute capability `arch`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import MockTensor, create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    try:
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        kwargs = dict(consts, num_warps=num_warps, num_stages=num_stages)
        wrapped = [MockTensor.wrap_dtype(a) for a in args]
        bound_args, specialization, options = binder(*wrapped, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    except (AttributeError, TypeError) as err:
        raise RuntimeError(
            f"triton {triton.__version__}: its compiler internals differ from what tapetrain's kernel report uses "
            f"({err}); install the triton version in pyproject.toml's dev extra"
        ) from err
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    return compiled.asm["ptx"], int(compiled.metadata.shared)


_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_resources(ptx: str, arch: int, shared_bytes: int) -> KernelResources:
    """Runs ptxas -v on `ptx` for `arch` and parses its report."""
    binaries = find_ptxas()
    if not binaries:
        raise FileNotFoundError("no ptxas found in the triton wheel (backends/nvidia/bin) or TRITON_PTXAS_PATH")
    errors = []
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        for ptxas in binaries:  # the plain ptxas may reject a newer PTX version; the blackwell one accepts it
            proc = subprocess.run(
                [str(ptxas), "-v", "--gpu-name", PTXAS_NAME[arch], str(src), "-o", str(Path(tmp) / "k.cubin")],
                capture_output=True,
                text=True,
            )
            if proc.returncode == 0:
                report = proc.stdout + proc.stderr
                regs, spills = _REGS.search(report), _SPILLS.search(report)
                if not regs or not spills:
                    raise RuntimeError(f"unexpected ptxas -v report:\n{report}")
                return KernelResources(
                    registers=int(regs.group(1)),
                    stack_frame_bytes=int(spills.group(1)),
                    spill_store_bytes=int(spills.group(2)),
                    spill_load_bytes=int(spills.group(3)),
                    shared_bytes=shared_bytes,
                )
            errors.append(f"{ptxas.name}: {proc.stderr.strip()[:300]}")
    raise RuntimeError("ptxas failed: " + " | ".join(errors))
