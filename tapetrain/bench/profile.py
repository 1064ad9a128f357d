"""Where a training step's time goes: each kernel (GPU) or operator (CPU) counted once, grouped by category.

Attribution rule: the self time of every profiler event of the measured device, except user annotations.
`torch.optim` wraps each step in a `record_function` range (`Optimizer.step#AdamW.step`), and on CUDA the profiler
gives that range device time of its own: the sum of its kernels. Counting it next to the kernels counted the
optimizer twice (an H100 profile showed 26.0 ms of "optimizer" for ~16 ms of AdamW kernels, and more device time
than wall time). Self times do not overlap, so the category sum of a serial stream cannot exceed the wall time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

CATEGORIES = (
    ("attention", ("_fwd_kernel", "_bwd_dkdv", "_bwd_dq", "_bwd_de", "flash", "fmha", "attention", "_attn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "sm90_", "sm80_", "ampere_",
                "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),  # fmt: skip
    ("loss", ("cross_entropy", "crossentropy", "log_softmax", "softmax", "nll_loss", "_ce_")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel", "clip", "[optimizer.")),
)


def category(name: str) -> str:
    """attention | matmul | loss | optimizer | elementwise (the rest: norms, rotations, SiLU, TAPE's updates)."""
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "elementwise"


def per_kernel_ms(events: Iterable, device: torch.device, steps: int) -> dict[str, float]:
    """{kernel or operator name: self time in ms per step} for the events of `device`, user annotations left out."""
    per: dict[str, float] = defaultdict(float)
    for evt in events:
        if getattr(evt, "is_user_annotation", False):
            continue
        if device.type == "cuda":
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            micros = evt.self_device_time_total
        else:
            if evt.device_type != torch.autograd.DeviceType.CPU:
                continue
            micros = evt.self_cpu_time_total
        if micros:
            per[evt.name + optimizer_scope(evt)] += micros / 1e3 / steps
    return dict(per)


def optimizer_scope(evt) -> str:
    """" [Optimizer.step]" for a CPU operator run inside torch.optim's step or zero_grad range (on CPU AdamW runs
    as plain aten::mul_/add_ that would otherwise count as elementwise), else ""."""
    parent = getattr(evt, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith("Optimizer."):
            return f" [{parent.name.split('#')[0]}]"
        parent = parent.cpu_parent
    return ""


def by_category(per_kernel: dict[str, float]) -> dict[str, float]:
    cats: dict[str, float] = defaultdict(float)
    for name, ms in per_kernel.items():
        cats[category(name)] += ms
    return dict(sorted(cats.items(), key=lambda kv: -kv[1]))


def profile_steps(step: Callable[[], object], steps: int, device: torch.device):
    """Run `step` `steps` times under torch.profiler: (wall ms per step, {kernel: ms per step}, the profiler)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            wall_ms = start.elapsed_time(end) / steps
        else:
            wall_ms = (time.perf_counter() - began) * 1e3 / steps
    return wall_ms, per_kernel_ms(prof.events(), device, steps), prof
