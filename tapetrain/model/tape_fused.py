"""Whether TAPE's E updates run as fused Triton kernels: model.tape_fused_updates (auto | true | false).

The fused kernels (tapetrain.kernels.tape_rotation, tape_head_mix, tape_mlp_update) compute exactly what the eager
modules in model/tape.py compute, without writing their E-sized intermediates. `auto` takes them only on a GPU
capability where the kernel record says their gpu-marked tests passed (kind "tape_update"), so a GPU
nobody has tested them on keeps the eager path; `true` takes them everywhere (on CPU through the Triton
interpreter, TRITON_INTERPRET=1 — slow, for end-to-end checks of the kernels), with one warning on an unverified
GPU; `false` never.
"""

from __future__ import annotations

import logging
import os

import torch

from tapetrain.model import kernel_record
from tapetrain.model.compile_constant import constant_to_compile

log = logging.getLogger("tapetrain.model")

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


_decisions: dict[tuple, bool] = {}


def use_fused_updates(setting: bool | str, device: torch.device, dtype: torch.dtype) -> bool:
    """Resolve model.tape_fused_updates for tensors on `device` of `dtype`; logs each new decision once."""
    if setting is False:
        return False
    return _resolve(setting, device.type, device.index, dtype)


@constant_to_compile
def _resolve(setting: bool | str, device_type: str, index: int | None, dtype: torch.dtype) -> bool:
    """The decision, made once per (setting, device, dtype) and a constant to torch.compile: the first call may run
    inside a compiled layer, and reading the kernel record there must not break its graph."""
    key = (setting, device_type, index, dtype)
    if key in _decisions:
        return _decisions[key]
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    if setting is True:
        reason = cannot_run_reason(device)
        if reason is not None:
            raise RuntimeError(f"model.tape_fused_updates=true: {reason}")
        if device.type == "cuda":
            kernel_record.warn_if_unverified(fused_path(device, dtype))
        choice = True
    else:
        choice = device.type == "cuda" and triton_installed() and kernel_record.is_verified(fused_path(device, dtype))
    _decisions[key] = choice
    log.info("TAPE's E updates (model.tape_fused_updates=%s) on %s %s: %s", setting, device_type,
             kernel_record.dtype_name(dtype), "fused Triton kernels" if choice else "eager")
    return choice


def plan_line(setting: bool | str, device: torch.device, dtype: torch.dtype) -> str:
    """--print-config's line: what the setting resolves to on this device, and whether that path is verified."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    head = f"TAPE's E updates (model.tape_fused_updates={str(setting).lower()} on {where}): "
    if setting is True and cannot_run_reason(device) is not None:
        return head + f"refused ({cannot_run_reason(device)})"
    fused = setting is True or (setting == "auto" and device.type == "cuda" and triton_installed()
                                and kernel_record.is_verified(fused_path(device, dtype)))
    if not fused:
        why = "asked for" if setting is False else (
            "auto: not verified on this GPU" if device.type == "cuda" else f"auto: eager on {device.type}")
        return head + f"eager ({why})"
    if device.type != "cuda":
        return head + "fused Triton kernels (CPU interpreter: correctness checks only)"
    verified = kernel_record.is_verified(fused_path(device, dtype))
    return head + "fused Triton kernels (" + ("verified" if verified else
                                              f"UNVERIFIED on this GPU; {kernel_record.HOW_TO_VERIFY}") + ")"


def clear_decisions() -> None:
    """Forget the decisions made (tests that change TRITON_INTERPRET or the record)."""
    _decisions.clear()
