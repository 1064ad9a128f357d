"""`train` mode: optimizer steps of TAPE and its RoPE twin (same preset, same everything but `pe`) in one
process: tokens/s, step time, MFU, peak memory. `--float8-list` adds each PE's train.float8 variants (torchao's
FP8 linears, tapetrain/train/float8.py), alternated with the others round by round."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tapetrain.bench.arguments import CPU_OR_CUDA, PRESET_LENGTH, add_model_args, add_report_args, add_steps_args, names
from tapetrain.bench.common import (
    DTYPES,
    PeakMemory,
    attention_backends_ran,
    device_name,
    pick_device,
    release_memory,
)
from tapetrain.bench.header import report_header
from tapetrain.bench.pairs import MAX_WARMUP_ROUNDS, MIN_HEADLINE_PAIRS, pair_ratios
from tapetrain.bench.report import bar_chart, finite_or_none, fmt_pct, format_table, noise_warning, title_suffix
from tapetrain.bench.steps import (
    PlainOptimizer,
    StepResult,
    build_model,
    interleaved_steps,
    plain_step,
    random_batches,
    steady_warmup,
    timed_steps,
    warm_up_process,
)
from tapetrain.model import POSITIONAL_ENCODINGS
from tapetrain.model.execution_plan import place_model
from tapetrain.train.float8 import convert_model_to_float8, emulation_requested, resolve_float8
from tapetrain.train.metrics import device_peak_flops

HELP = "training-step throughput of TAPE and its RoPE twin in one run"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_report_args(p)
    add_model_args(p, seq_len=PRESET_LENGTH, batch=CPU_OR_CUDA)
    add_steps_args(p)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--pe-list", type=names, default=["tape", "rope"], help="positional encodings (default tape,rope)")
    p.add_argument("--float8-list", type=names, default=["off"],
                   help="train.float8 settings per PE, e.g. off,rowwise,tensorwise (default off); a variant per pair")


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
    float8_list: list[str] = field(default_factory=lambda: ["off"])
    peak_tflops: float | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"
    seed: int = 0


def variant_name(pe: str, float8: str) -> str:
    """`tape`, or `tape+float8-rowwise`: the key of a variant's results."""
    return pe if float8 == "off" else f"{pe}+float8-{float8}"


def run_train_benchmark(s: TrainSettings, progress: bool = True) -> dict:
    """One model per PE, each built and warmed up alone (its peak memory), then their optimizer steps alternated
    round by round (`steps` rounds, order rotated): the TAPE/RoPE ratio is the median of the per-round ratio."""
    unknown = [pe for pe in s.pe_list if pe not in POSITIONAL_ENCODINGS]
    if unknown:
        raise ValueError(f"--pe-list: unknown {', '.join(unknown)}; choose from {', '.join(POSITIONAL_ENCODINGS)}")
    if s.steps < 1:
        raise ValueError("--steps must be ≥ 1")
    device = pick_device(s.device)
    for setting in s.float8_list:
        resolve_float8(setting, device)  # a recipe this device cannot run: refused before anything is built
    variants = [(pe, f8) for pe in s.pe_list for f8 in s.float8_list]
    dtype = DTYPES[s.dtype]
    peak = device_peak_flops(device, s.peak_tflops)
    result: dict[str, Any] = {
        **report_header("train", device_name(device)),
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
        "pe_list": [variant_name(pe, f8) for pe, f8 in variants],
        "float8_list": list(s.float8_list),
    }
    warm_up_process(device, dtype)
    step_fns, models, memory, batches = {}, {}, {}, None
    for pe, f8 in variants:  # built and warmed up one by one (memory measured alone), then kept for the rounds
        name = variant_name(pe, f8)
        with PeakMemory(device) as mem:
            model = build_model(
                s.preset, pe, s.seq_len, backend=s.backend, activation_checkpointing=s.activation_checkpointing,
                overrides=s.overrides, seed=s.seed,
            )  # fmt: skip
            if f8 != "off":
                convert_model_to_float8(model, f8, emulate=emulation_requested())
            place_model(model, device, dtype).train()
            if batches is None:
                batches = random_batches(model.cfg.vocab_size, s.batch, s.seq_len, device, min(s.steps, 4), 1)
            step_fns[name] = plain_step(model, PlainOptimizer(model))
            timed_steps(step_fns[name], batches, device, s.warmup, 0, f"{name} warm-up", progress)
        models[name], memory[name] = model, mem
    both = "tape" in step_fns and "rope" in step_fns
    # Alternated warm-up until the TAPE/RoPE ratio is steady (the per-PE warm-up above pays compilation only).
    drift = steady_warmup(step_fns, batches, device, "tape", "rope", 0, MAX_WARMUP_ROUNDS) if both else None
    times, losses = interleaved_steps(step_fns, batches, device, s.steps, progress,
                                      first_round=drift["rounds"] if drift else 0)
    for name in result["pe_list"]:
        result[name] = StepResult.of_model(models[name], times[name], losses[name], s.batch, s.seq_len, peak,
                                           memory[name]).to_dict()  # fmt: skip
    ran = attention_backends_ran(list(models.values()), device)
    # each float8 variant against its PE in high precision, round by round: > 1 = float8 is faster
    result["float8_speedup"] = {variant_name(pe, f8): pair_ratios(times[pe], times[variant_name(pe, f8)])
                                for pe, f8 in variants if f8 != "off" and pe in times} or None
    # the target: TAPE in float8 no slower than RoPE in high precision (< 1 = faster)
    result["tape_float8_over_rope_step_time"] = {
        variant_name("tape", f8): pair_ratios(times[variant_name("tape", f8)], times["rope"])
        for f8 in s.float8_list if f8 != "off" and "tape" in s.pe_list and "rope" in times} or None
    del step_fns, models, batches
    release_memory(device)
    has_both = "tape" in result and "rope" in result
    ratio = pair_ratios(times["tape"], times["rope"]) if has_both else None
    result["attention_ran"] = ran
    result["pairs"] = s.steps
    result["headline"] = s.steps >= MIN_HEADLINE_PAIRS
    result["tape_over_rope_step_time"] = ratio["median"] if ratio else None  # median of the per-round ratio
    result["tape_over_rope_step_time_spread"] = ratio
    result["warmup_drift"] = drift
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
        f"backend {result['backend']}, {result['steps']} alternated rounds after {result['warmup']} warmup, "
        f"{result['device']}" + (", activation checkpointing" if result["activation_checkpointing"] else ""),
        format_table(headers, rows),
    ]
    spread = result.get("tape_over_rope_step_time_spread")
    if spread:
        lines.append(f"TAPE / RoPE step time: {spread['median']:.3f} per-round median (IQR {spread['q1']:.3f}–"
                     f"{spread['q3']:.3f}, min–max {spread['min']:.3f}–{spread['max']:.3f}, {spread['pairs']} pairs; "
                     "target ≤ 1.10)" + ("" if spread["headline"] else "; not a headline: fewer than 10 pairs"))
    for name, ratio in (result.get("float8_speedup") or {}).items():
        lines.append(f"{name}: {ratio['median']:.3f}× the speed of its high-precision twin, per-round median (IQR "
                     f"{ratio['q1']:.3f}–{ratio['q3']:.3f}, {ratio['pairs']} pairs)")
    for name, ratio in (result.get("tape_float8_over_rope_step_time") or {}).items():
        lines.append(f"{name} / rope step time: {ratio['median']:.3f} per-round median (target ≤ 1.00)")
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
