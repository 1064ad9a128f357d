"""What every Triton kernel module in tapetrain/kernels shares: launch configs, the launcher that tries them, the
launch capture behind the kernel report, and the input checks of the ops.

A module keeps one `KernelLauncher` and launches each kernel through it with the configs to try, best first:
the first that compiles is used (OutOfResources from the compiler: the next) and, given a key, remembered, so the
next launch with that key goes straight to it. Inside `launcher.capture(arch, **labels)` nothing runs: each launch
is recorded as a `Launch` (kernel, arguments, constexprs, the configs the runtime would try on `arch`). Each module's
`report_launches(arch, dtype) -> list[Launch]` returns its launches at model shapes for tools/kernel_report.py,
which compiles them for `arch` (tapetrain.kernels.ptx_report) and reads `ptxas -v`: no GPU needed.

On CPU the kernels run in Triton's interpreter when TRITON_INTERPRET=1 was set before triton was first imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class LaunchConfig:
    """The tunable part of a launch: BLOCK_* constexprs as (name, value) pairs, warps, pipeline stages."""

    blocks: tuple[tuple[str, int], ...]
    num_warps: int
    num_stages: int

    @classmethod
    def of(cls, num_warps: int, num_stages: int, **blocks: int) -> LaunchConfig:
        return cls(tuple(blocks.items()), num_warps, num_stages)

    def __getitem__(self, block: str) -> int:
        return dict(self.blocks)[block]

    def as_dict(self) -> dict[str, int]:
        """The launch keyword arguments (and the kernel report's "config")."""
        return {**dict(self.blocks), "num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass
class Launch:
    """One recorded launch, all that ptx_report.compile_ptx needs, and what names it in the kernel report."""

    name: str  # the kernel function's name; "name:pass" when one kernel runs in several passes
    kernel: object  # the @triton.jit function
    args: tuple  # positional arguments; meta tensors stand for pointers
    consts: dict  # constexpr arguments other than the config's
    configs: list[LaunchConfig]  # what the runtime tries on the capture's arch, in order: configs[0] is chosen
    labels: dict  # what tells it apart in the report beside kernel, arch, dtype, e.g. {"shape": "llama-1b ..."}
    candidates: list[LaunchConfig] = field(default_factory=list)  # a tuning search's configs (GPU timing)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def pad_for_dot(n: int) -> int:
    """A tile extent for n: the next power of two, at least 16 (tl.dot's minimum); the padding is masked."""
    return max(16, triton.next_power_of_2(n))


def dot_precision(dtype: torch.dtype) -> str | None:
    """tl.dot input precision: only meaningful for fp32 operands (None = the backend's default)."""
    if dtype != torch.float32:
        return None
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


class KernelLauncher:
    """Launches one kernel module's kernels; `op` names the module's op in errors."""

    def __init__(self, op: str, probe_kernel) -> None:
        self.op = op
        self._probe = probe_kernel  # one of the module's @triton.jit kernels (was it built for the interpreter?)
        self._chosen: dict[tuple, LaunchConfig] = {}
        self._capture: list[Launch] | None = None
        self._capture_arch = 0
        self._labels: dict = {}

    def arch(self, x: torch.Tensor) -> int:
        """Compute capability (10·major + minor) the launches on x's device target: the capture's arch while
        capturing, 0 under the interpreter."""
        if self._capture is not None:
            return self._capture_arch
        if interpreting():
            return 0
        major, minor = torch.cuda.get_device_capability(x.device)
        return 10 * major + minor

    def launch(
        self,
        kernel,
        name: str,
        grid: Callable[[LaunchConfig], tuple[int, ...]],
        configs: Sequence[LaunchConfig],
        args: tuple,
        consts: dict,
        key: tuple | None = None,
    ) -> None:
        """Run `kernel` on grid(config) with the first of `configs` that compiles; with a `key`, the config that
        did is remembered and used directly for the next launch of `name` with that key."""
        if self._capture is not None:
            self._capture.append(Launch(name, kernel, args, dict(consts), list(configs), dict(self._labels)))
            return
        if key is not None and (name, key) in self._chosen:
            configs = [self._chosen[name, key]]
        last: Exception | None = None
        for config in configs:
            shape = grid(config)
            if 0 in shape:
                return
            try:
                kernel[shape](*args, **consts, **config.as_dict())
            except OutOfResources as err:
                last = err
                continue
            if key is not None:
                self._chosen[name, key] = config
            return
        tried = ", ".join(str(c.as_dict()) for c in configs)
        raise RuntimeError(f"{self.op}: no launch config of {name} fits this GPU (tried {tried})") from last

    def forget_chosen(self) -> None:
        self._chosen.clear()

    @contextmanager
    def capture(self, arch: int, **labels) -> Iterator[list[Launch]]:
        """Record the launches made inside the block for compute capability `arch` instead of running them (the
        launch code runs on meta tensors); each Launch carries `labels`."""
        if self._capture is not None:
            raise RuntimeError(f"{self.op}: launch capture already under way")
        self._capture, self._capture_arch, self._labels = [], arch, labels
        try:
            yield self._capture
        finally:
            self._capture, self._capture_arch, self._labels = None, 0, {}

    def check_inputs(self, tensors: dict[str, torch.Tensor | None], *, same_dtype: Sequence[str],
                     float_dtype: Sequence[str] = ()) -> None:  # fmt: skip
        """The checks every op shares: the `same_dtype` tensors share one of fp32/fp16/bf16, the `float_dtype`
        ones are each one of them, all sit on one device, and that is a GPU or the CPU under a ready interpreter."""
        given = {n: t for n, t in tensors.items() if t is not None}
        shared = [given[n] for n in same_dtype if n in given]
        if any(t.dtype != shared[0].dtype for t in shared) or shared[0].dtype not in FLOAT_DTYPES:
            names = ", ".join(n for n in same_dtype if n in given)
            raise ValueError(f"{self.op}: {names} must share one of fp32/fp16/bf16; got {[t.dtype for t in shared]}")
        for n in float_dtype:
            if n in given and given[n].dtype not in FLOAT_DTYPES:
                raise ValueError(f"{self.op}: {n} must be fp32/fp16/bf16; got {given[n].dtype}")
        device = shared[0].device
        if any(t.device != device for t in given.values()):
            raise ValueError(f"{self.op}: {', '.join(given)} must be on one device")
        if device.type != "cuda":
            if not interpreting():
                raise RuntimeError(f"{self.op} runs on CUDA, or on CPU only under TRITON_INTERPRET=1")
            self._check_interpreter_ready()

    def _check_interpreter_ready(self) -> None:
        """Under TRITON_INTERPRET=1, triton's own @jit library functions (tl.zeros since triton 3.9) and the
        module's kernels must have been built for the interpreter, i.e. triton imported after the variable was
        set; else the interpreter fails deep in the kernel with "Cannot call @triton.jit'd outside of the scope of
        a kernel"."""
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        library = [f for f in (getattr(tl, "zeros", None), getattr(tl, "cdiv", None)) if isinstance(f, JITFunction)]
        if any(not isinstance(f, InterpretedFunction) for f in library) or not isinstance(
            self._probe, InterpretedFunction
        ):
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton was imported (DeepSpeed, transformers and torch.compile "
                "import it), so triton's library functions were built for the GPU compiler, not the CPU "
                "interpreter; set TRITON_INTERPRET=1 in the environment before anything imports triton (e.g. on "
                "the command line)"
            )
