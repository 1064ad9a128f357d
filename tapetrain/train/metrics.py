"""Step metrics: metrics.jsonl (one JSON object per logged step), TensorBoard, and a console line with ETA."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch

from tapetrain import atomic_io

log = logging.getLogger("tapetrain.train")

# Dense bf16 peak FLOP/s per device, for MFU. Unknown devices (CPU included) report MFU only with train.peak_tflops.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "A10G": 125e12, "L40S": 362e12, "4090": 165e12}


def device_peak_flops(device: torch.device, override_tflops: float | None = None) -> float:
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in PEAK_BF16_FLOPS.items():
            if key in name:
                return peak
    return math.nan


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    except ImportError:  # pragma: no cover - non-Unix
        return math.nan


class MetricsLogger:
    """Rank 0 only: appends to metrics.jsonl, writes TensorBoard scalars, prints a progress line."""

    def __init__(self, run_dir: Path, total_steps: int, tensorboard: bool, start_step: int, name: str | None = None,
                 mirror=None):
        """`mirror`: another sink for the written records (tapetrain.train.wandb_mirror.WandbMirror) or None."""
        self.path = run_dir / "metrics.jsonl"
        self.mirror = mirror
        self.total_steps = total_steps
        self.start_step = start_step
        self.name = name
        self.started = time.perf_counter()
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)
            if name:
                self.writer.add_text("run/name", name, start_step)
        self._truncate_after(start_step)

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint (they will be logged again), so the file stays one
        line per step."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
        atomic_io.write_text(self.path, "".join(line + "\n" for line in kept))

    def log(self, record: dict, write: bool = True, show: bool = True) -> None:
        """`write`: metrics.jsonl and TensorBoard (train.log_interval); `show`: the console line
        (logging.console_interval)."""
        if write:
            self._write(record)
        if show:
            self._show(record)

    def _write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        step = record["step"]
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(
                        f"train/{key}" if not key.startswith("val_") else f"val/{key[4:]}", value, step
                    )
            self.writer.flush()
        if self.mirror is not None:
            self.mirror.log(record)

    def _show(self, record: dict) -> None:
        step = record["step"]
        done = step - self.start_step
        elapsed = time.perf_counter() - self.started
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        if "loss" in record:
            log.info(
                "%sstep %d/%d | loss %s | lr %s | grad_norm %s | %s tok/s | mfu %s | mem %s GB | eta %s",
                f"{self.name} " if self.name else "",
                step,
                self.total_steps,
                _fmt(record["loss"], ".4f"),
                _fmt(record["lr"], ".3g"),
                _fmt(record.get("grad_norm"), ".3g"),
                _fmt(record.get("tokens_per_s"), ".0f"),
                _fmt(record.get("mfu"), ".1%"),
                _fmt(record.get("mem_gb"), ".2f"),
                _fmt_duration(eta),
            )
        else:
            log.info("step %d | %s", step, " ".join(f"{k} {_fmt(v, '.4g')}" for k, v in record.items() if k != "step"))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.mirror is not None:
            self.mirror.close()


def _fmt(value, spec: str) -> str:
    """Format a metric that may be missing or non-finite (written to metrics.jsonl as null)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    return format(value, spec)


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
