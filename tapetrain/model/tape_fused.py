"""Whether TAPE's E updates run as fused Triton kernels: model.tape_fused_updates (auto | true | false).

The fused kernels (tapetrain.kernels.tape_rotation, tape_head_mix, tape_mlp_update) compute exactly what the eager
modules in model/tape.py compute, without writing their E-sized intermediates. `auto` takes them only on a GPU
capability where the kernel record says their gpu-marked tests passed (kind "tape_update"), so a GPU
nobody has tested them on keeps the eager path; `true` takes them everywhere (on CPU through the Triton
interpreter, TRITON_INTERPRET=1 — slow, for end-to-end checks of the kernels), with one warning on an unverified
GPU; `false` never. The decision is made once per process by the execution plan (model/execution_plan.py); the
modules are handed a plain bool.
"""

from __future__ import annotations

import os

import torch

from tapetrain.errors import ConfigError
from tapetrain.model import kernel_record

KIND = "tape_update"
INTERPRETER_HINT = ("set TRITON_INTERPRET=1 in the environment before the run starts (the kernels then run in "
                    "Triton's CPU interpreter: slow, for checks), or set model.tape_fused_updates=auto")


def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def fused_path(device: torch.device, dtype: torch.dtype) -> kernel_record.KernelKey:
    """The kernel-record key of the fused updates on a CUDA device."""
    capability, dtype_name = kernel_record.capability_of(device), kernel_record.dtype_name(dtype)
    return kernel_record.KernelKey(KIND, "triton", capability, dtype_name)


def cannot_run_reason(device: torch.device) -> str | None:
    """Why `true` cannot run the kernels on `device` (None when it can)."""
    if not triton_installed():
        return "triton is not installed (pip install 'tapetrain[gpu]', or triton)"
    if device.type != "cuda" and not interpreter_on():
        return f"the kernels run on CUDA, or on {device.type} only in Triton's interpreter; {INTERPRETER_HINT}"
    return None


def resolve_fused_updates(setting: bool | str, device: torch.device, dtype: torch.dtype, *, warn: bool = True) -> bool:
    """model.tape_fused_updates for `device` and `dtype`, as the execution plan (model/execution_plan.py) decides it
    once: true must be able to run (else a ConfigError naming the variable or `auto`), auto only where verified."""
    if setting is False:
        return False
    if setting is True:
        reason = cannot_run_reason(device)
        if reason is not None:
            raise ConfigError(f"model.tape_fused_updates=true cannot run on this {device.type} machine: {reason}")
        if warn and device.type == "cuda":
            kernel_record.warn_if_unverified(fused_path(device, dtype))
        return True
    return device.type == "cuda" and triton_installed() and kernel_record.is_verified(fused_path(device, dtype))
