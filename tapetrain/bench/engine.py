"""`engine` mode: DeepSpeed overhead, a one-rank DeepSpeed engine vs a plain PyTorch loop doing the same
arithmetic (model, batches, AdamW, clipping)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tapetrain.bench.arguments import CPU_OR_CUDA, PRESET_LENGTH, add_model_args, add_report_args, add_steps_args
from tapetrain.bench.common import (
    DTYPES,
    PeakMemory,
    attention_backends_ran,
    device_name,
    release_memory,
)
from tapetrain.bench.header import report_header
from tapetrain.bench.pairs import pair_ratios
from tapetrain.bench.report import bar_chart, finite_or_none, fmt_pct, format_table, noise_warning, title_suffix
from tapetrain.bench.steps import (
    PlainOptimizer,
    StepResult,
    adamw,
    build_model,
    interleaved_steps,
    plain_step,
    random_batches,
    timed_steps,
    warm_up_process,
)
from tapetrain.model import Transformer
from tapetrain.model.execution_plan import place_model, resolve_plan
from tapetrain.train.metrics import device_peak_flops

ENGINE_TARGET = 0.9  # DeepSpeed tokens/s over plain PyTorch (the framework overhead should stay small)


HELP = "DeepSpeed engine (one rank) vs a plain PyTorch loop"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_report_args(p, device=False)  # the device DeepSpeed's accelerator picks
    add_model_args(p, seq_len=PRESET_LENGTH, batch=CPU_OR_CUDA)
    add_steps_args(p)
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--pe", default="tape", help="positional encoding of the model (default tape)")


@dataclass
class EngineSettings:
    preset: str
    seq_len: int
    batch: int
    steps: int
    warmup: int
    dtype: str = "fp32"
    zero_stage: int = 2
    pe: str = "tape"
    backend: str = "auto"
    peak_tflops: float | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


def engine_ds_config(s: EngineSettings) -> dict[str, Any]:
    """DeepSpeed JSON for one rank, built by tapetrain.config (the only module that knows DeepSpeed's keys), so
    the engine measured is configured as the trainer's."""
    from tapetrain.config import DeepSpeedSection, RunConfig, TrainSection, build_deepspeed_config

    cfg = RunConfig(
        train=TrainSection(micro_batch_size=s.batch, global_batch_size=s.batch, grad_clip=1.0),
        deepspeed=DeepSpeedSection(zero_stage=s.zero_stage, precision=s.dtype),
    )
    return build_deepspeed_config(cfg, world_size=1)


def run_engine_benchmark(s: EngineSettings, progress: bool = True) -> dict:
    """A plain PyTorch loop and a DeepSpeed engine on the same model, batches, optimizer and clipping, their steps
    alternated round by round (`steps` rounds, order rotated)."""
    import deepspeed

    from tapetrain.distributed import destroy_process_group, init_distributed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-engine INFO banner drowns the table
    owns_group = not torch.distributed.is_initialized()
    env = init_distributed()  # a lone process declares itself rank 0 of 1 on a free port
    if env.world_size != 1:
        raise RuntimeError(f"engine mode measures ONE rank; got WORLD_SIZE={env.world_size}; run it without a launcher")
    device = env.device
    dtype = DTYPES[s.dtype]
    peak = device_peak_flops(device, s.peak_tflops)
    ds_config = engine_ds_config(s)

    def make_model() -> Transformer:
        return build_model(s.preset, s.pe, s.seq_len, backend=s.backend, overrides=s.overrides, seed=s.seed)

    def stats(times: list[float], loss: float, model: Transformer, mem: PeakMemory) -> dict:
        return StepResult.of_model(model, times, loss, s.batch, s.seq_len, peak, mem).to_dict()

    warm_up_process(device, dtype)
    with PeakMemory(device) as plain_mem:  # each loop built and warmed up alone (its memory), then alternated
        plain_model = place_model(make_model(), device, dtype).train()
        batches = random_batches(plain_model.cfg.vocab_size, s.batch, s.seq_len, device, min(s.steps, 4), 1)
        plain_fn = plain_step(plain_model, PlainOptimizer(plain_model))
        timed_steps(plain_fn, batches, device, s.warmup, 0, "plain warm-up", progress)
    with PeakMemory(device) as ds_mem:
        ds_model = make_model()  # fp32; DeepSpeed casts the module for bf16/fp16 and keeps fp32 master weights
        ds_model.use_plan(resolve_plan(ds_model.cfg, device, dtype))
        optimizer = adamw(ds_model.parameters(), fused=device.type == "cuda")
        engine, *_ = deepspeed.initialize(model=ds_model, optimizer=optimizer, config=ds_config,
                                          dist_init_required=False)  # fmt: skip

        def ds_step(ids: torch.Tensor, engine: Any = engine) -> torch.Tensor:
            loss = engine(ids[:, :-1], labels=ids[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            return loss

        timed_steps(ds_step, batches, device, s.warmup, 0, "deepspeed warm-up", progress)
    times, losses = interleaved_steps({"plain": plain_fn, "deepspeed": ds_step}, batches, device, s.steps, progress)
    plain = stats(times["plain"], losses["plain"], plain_model, plain_mem)
    ds = stats(times["deepspeed"], losses["deepspeed"], ds_model, ds_mem)
    ratio = pair_ratios(times["plain"], times["deepspeed"])  # plain time / DeepSpeed time = DS tokens/s over plain
    attention_ran = attention_backends_ran([plain_model, ds_model], device)
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, ds_model, plain_model, plain_fn, batches
    release_memory(device)
    if owns_group:
        destroy_process_group()

    return {
        **report_header("engine", device_name(device)),
        "preset": s.preset,
        "pe": s.pe,
        "seq_len": s.seq_len,
        "batch": s.batch,
        "dtype": s.dtype,
        "zero_stage": s.zero_stage,
        "backend": s.backend,
        "steps": s.steps,
        "warmup": s.warmup,
        "overrides": s.overrides,
        "peak_flops": finite_or_none(peak),
        "ds_config": ds_config,
        "plain": plain,
        "deepspeed": ds,
        "deepspeed_over_plain_tokens_per_s": ratio["median"],  # median of the per-round ratio
        "deepspeed_over_plain_spread": ratio,
        "attention_ran": attention_ran,
        "pairs": s.steps,
        "headline": ratio["headline"],
        "target": ENGINE_TARGET,
    }


def engine_report(result: dict) -> str:
    headers = ["loop", "step s", "tokens/s", "MFU", "peak mem GB", "final loss"]
    loops = (("plain PyTorch", result["plain"]), (f"DeepSpeed ZeRO-{result['zero_stage']}", result["deepspeed"]))
    rows = [
        [name, r["step_s"], r["tokens_per_s"], fmt_pct(r["mfu"]), r["peak_mem_gb"], r["final_loss"]]
        for name, r in loops
    ]
    ratio = result["deepspeed_over_plain_tokens_per_s"]
    spread = result["deepspeed_over_plain_spread"]
    verdict = "meets" if ratio >= result["target"] else "below"
    return "\n".join(
        [
            f"engine: {result['preset']} ({result['pe']}), seq_len {result['seq_len']}, batch {result['batch']}, "
            f"{result['dtype']}, 1 rank, {result['steps']} alternated rounds after {result['warmup']} warmup, "
            f"{result['device']}",
            format_table(headers, rows),
            f"DeepSpeed / plain tokens/s: {ratio:.3f} per-round median (IQR {spread['q1']:.3f}–{spread['q3']:.3f}, "
            f"{spread['pairs']} pairs; {verdict} target ≥ {result['target']:.2f})"
            + ("" if result["headline"] else "; not a headline: fewer than 10 pairs"),
            *noise_warning([result["plain"], result["deepspeed"]]),
        ]
    )


def plot_engine(result: dict, path: str | Path) -> Path:
    """Bar chart: plain PyTorch loop vs DeepSpeed engine tokens/s."""
    labels = ["plain PyTorch", f"DeepSpeed ZeRO-{result['zero_stage']}"]
    values = [result["plain"]["tokens_per_s"], result["deepspeed"]["tokens_per_s"]]
    title = (
        f"DeepSpeed overhead: {result['preset']} ({result['pe']}), seq {result['seq_len']}, batch {result['batch']}"
        f"\n({title_suffix(result)})"
    )
    return bar_chart(labels, values, title, path, "tokens/s")
