"""Device, dtype, timing and peak-memory helpers shared by every benchmark (definitions: the package docstring)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GIB = 2**30


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was given but CUDA is not available; use --device cpu")
    return device


def default_dtype(device: torch.device) -> str:
    return "bf16" if device.type == "cuda" else "fp32"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        match = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        if match:
            cpu = match.group(1).strip()
    return f"cpu: {cpu}, threads={torch.get_num_threads()}"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Seconds per call for `iters` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def _proc_status_kib(key: str) -> int | None:
    with contextlib.suppress(OSError, AttributeError):
        match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
        return int(match.group(1)) if match else None
    return None


def release_memory(device: torch.device) -> None:
    """Give freed memory back (CUDA cache; glibc heap) so the next measurement starts from a clean baseline."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakMemory:
    """Peak memory of a `with` block in GiB (defined in the `tapetrain.bench` docstring); `.gb` is None where
    unmeasurable."""

    def __init__(self, device: torch.device):
        self.device = device
        self.gb: float | None = None
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "host_rss_delta"
        self._base_kib: int | None = None
        self._base_bytes = 0

    def __enter__(self) -> PeakMemory:
        release_memory(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base_bytes = torch.cuda.memory_allocated(self.device)  # another variant may still be resident
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux ≥ 4.0)
                self._base_kib = _proc_status_kib("VmRSS")
            except OSError:
                self._base_kib = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.gb = (torch.cuda.max_memory_allocated(self.device) - self._base_bytes) / GIB
        elif self._base_kib is not None:
            peak = _proc_status_kib("VmHWM")
            self.gb = (peak - self._base_kib) / 2**20 if peak is not None else None


def attention_backends_ran(models: list[torch.nn.Module], device: torch.device) -> dict[str, Any]:
    """What the measured models ran, from their execution plans (model/execution_plan.py): the attention backends
    (e.g. cuDNN SDPA or Triton on Hopper), whether TAPE's E updates were fused, and on CPU from how many keys SDPA
    splits TAPE's values into two calls."""
    from tapetrain.model import attention
    from tapetrain.model.execution_plan import paths_ran

    ran: dict[str, Any] = paths_ran([model.plan for model in models])
    if device.type == "cpu":
        ran["cpu_sdpa_two_calls_from_keys"] = attention.CPU_TWO_CALLS_FROM_KEYS
    return ran
