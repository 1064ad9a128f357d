"""`train` mode: optimizer steps of TAPE and its RoPE twin (same preset, same everything but `pe`) in one
process: tokens/s, step time, MFU, peak memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tapetrain.bench.common import DTYPES, PeakMemory, device_name, pick_device, release_memory, software_versions
from tapetrain.bench.report import bar_chart, finite_or_none, fmt_pct, format_table, noise_warning, title_suffix
from tapetrain.bench.steps import (
    PlainOptimizer,
    StepResult,
    build_model,
    plain_step,
    random_batches,
    timed_steps,
    warm_up_process,
)
from tapetrain.model import POSITIONAL_ENCODINGS
from tapetrain.train.metrics import device_peak_flops


@dataclass
class TrainSettings:
    preset: str
    seq_len: int
    batch: int
    steps: int
    warmup: int
    dtype: str = "fp32"
    backend: str = "auto"
    activation_checkpointing: bool = False
    pe_list: list[str] = field(default_factory=lambda: ["tape", "rope"])
    peak_tflops: float | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"
    seed: int = 0


def run_train_benchmark(s: TrainSettings, progress: bool = True) -> dict:
    """One model per PE, built, warmed up, timed and freed in turn (never two in memory at once)."""
    unknown = [pe for pe in s.pe_list if pe not in POSITIONAL_ENCODINGS]
    if unknown:
        raise ValueError(f"--pe-list: unknown {', '.join(unknown)}; choose from {', '.join(POSITIONAL_ENCODINGS)}")
    if s.steps < 1:
        raise ValueError("--steps must be ≥ 1")
    device = pick_device(s.device)
    dtype = DTYPES[s.dtype]
    peak = device_peak_flops(device, s.peak_tflops)
    result: dict[str, Any] = {
        "mode": "train",
        "device": device_name(device),
        "preset": s.preset,
        "seq_len": s.seq_len,
        "batch": s.batch,
        "dtype": s.dtype,
        "backend": s.backend,
        "activation_checkpointing": s.activation_checkpointing,
        "steps": s.steps,
        "warmup": s.warmup,
        "overrides": s.overrides,
        "peak_flops": finite_or_none(peak),
        "optimizer": "torch AdamW (fused on CUDA), grad clip 1.0"
        + (", fp32 master weights" if dtype != torch.float32 else ""),
        "versions": software_versions(),
        "pe_list": list(s.pe_list),
    }
    warm_up_process(device, dtype)
    for pe in s.pe_list:
        with PeakMemory(device) as mem:
            model = build_model(
                s.preset, pe, s.seq_len, backend=s.backend, activation_checkpointing=s.activation_checkpointing,
                overrides=s.overrides, seed=s.seed,
            )  # fmt: skip
            model.to(device=device, dtype=dtype).train()
            opt = PlainOptimizer(model)
            batches = random_batches(model.cfg.vocab_size, s.batch, s.seq_len, device, min(s.steps + s.warmup, 4), 1)
            times, loss = timed_steps(plain_step(model, opt), batches, device, s.warmup, s.steps, pe, progress)
        result[pe] = StepResult.of_model(model, times, loss, s.batch, s.seq_len, peak, mem).to_dict()
        del model, opt, batches
        release_memory(device)
    has_both = "tape" in result and "rope" in result
    result["tape_over_rope_step_time"] = result["tape"]["step_s"] / result["rope"]["step_s"] if has_both else None
    return result


def train_report(result: dict) -> str:
    rope = result.get("rope")
    headers = ["pe", "params M", "step s", "tokens/s", "MFU", "peak mem GB", "step time / rope"]
    rows = []
    for pe in result["pe_list"]:
        r = result[pe]
        ratio = r["step_s"] / rope["step_s"] if rope else None
        rows.append([pe, r["params"] / 1e6, r["step_s"], r["tokens_per_s"], fmt_pct(r["mfu"]), r["peak_mem_gb"], ratio])
    lines = [
        f"train: {result['preset']}, seq_len {result['seq_len']}, batch {result['batch']}, {result['dtype']}, "
        f"backend {result['backend']}, {result['steps']} steps after {result['warmup']} warmup, "
        f"{result['device']}" + (", activation checkpointing" if result["activation_checkpointing"] else ""),
        format_table(headers, rows),
    ]
    if result["tape_over_rope_step_time"] is not None:
        lines.append(f"TAPE / RoPE step time: {result['tape_over_rope_step_time']:.3f} (target ≤ 1.10)")
    if result["peak_flops"] is None:
        lines.append("MFU: n/a (unknown device peak; pass --peak-tflops)")
    lines += noise_warning([result[pe] for pe in result["pe_list"]])
    kind = result[result["pe_list"][0]]["peak_mem_kind"]
    if kind == "host_rss_delta":
        lines.append("peak mem: host RSS peak above the RSS before the model was built")
    return "\n".join(lines)


def plot_train(result: dict, path: str | Path) -> Path:
    """Bar chart of training tokens/s per positional encoding."""
    pes = [pe for pe in result["pe_list"] if result[pe].get("tokens_per_s") is not None]
    title = (
        f"training throughput: {result['preset']}, seq {result['seq_len']}, batch {result['batch']}\n"
        f"({title_suffix(result)})"
    )
    return bar_chart(pes, [result[pe]["tokens_per_s"] for pe in pes], title, path, "tokens/s")
