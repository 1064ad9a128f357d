"""The header every benchmark report starts with: which mode ran, when, on what, with which software.

Every mode's JSON begins with `report_header`, so that any two reports can be compared field by field
(tests/unit/test_benchmark_tool.py fails if a mode builds these fields itself).
"""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from typing import Any

import torch

HEADER_KEYS = ("mode", "date", "device", "machine", "versions")


def report_header(mode: str, device: str) -> dict[str, Any]:
    """The header fields of `mode`'s report. `device`: the measured device's name (common.device_name) as the
    measuring process saw it (sp: a rank's, whose thread count differs from the launcher's)."""
    return {
        "mode": mode,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "machine": machine(),
        "versions": software_versions(),
    }


def machine() -> str:
    """OS, architecture and CPU count, e.g. 'Linux 6.8.0 x86_64, 16 CPUs' (no host name)."""
    return f"{platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} CPUs"


def software_versions() -> dict[str, str | None]:
    from importlib import metadata  # not importing the packages: deepspeed alone costs seconds and logs

    versions: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("deepspeed", "triton", "flash-attn"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions
