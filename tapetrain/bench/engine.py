"""`engine` mode: DeepSpeed overhead, a one-rank DeepSpeed engine vs a plain PyTorch loop doing the same
arithmetic (model, batches, AdamW, clipping)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tapetrain.bench.common import DTYPES, PeakMemory, device_name, release_memory, software_versions
from tapetrain.bench.report import bar_chart, finite_or_none, fmt_pct, format_table, noise_warning, title_suffix
from tapetrain.bench.steps import (
    PlainOptimizer,
    StepResult,
    adamw,
    build_model,
    plain_step,
    random_batches,
    timed_steps,
    warm_up_process,
)
from tapetrain.model import Transformer
from tapetrain.train.metrics import device_peak_flops

ENGINE_TARGET = 0.9  # DeepSpeed tokens/s over plain PyTorch (the framework overhead should stay small)


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
    """Plain PyTorch loop, then a DeepSpeed engine, on the same model, batches, optimizer and clipping."""
    import deepspeed

    from tapetrain.distributed import init_distributed

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

    n_batches = min(s.steps + s.warmup, 4)
    warm_up_process(device, dtype)
    with PeakMemory(device) as mem:
        model = make_model().to(device=device, dtype=dtype).train()
        opt = PlainOptimizer(model)
        batches = random_batches(model.cfg.vocab_size, s.batch, s.seq_len, device, n_batches, 1)
        times, loss = timed_steps(plain_step(model, opt), batches, device, s.warmup, s.steps, "plain", progress)
    plain = stats(times, loss, model, mem)
    del model, opt
    release_memory(device)

    with PeakMemory(device) as mem:
        model = make_model()  # fp32; DeepSpeed casts the module for bf16/fp16 and keeps fp32 master weights
        optimizer = adamw(model.parameters(), fused=device.type == "cuda")
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, dist_init_required=False)

        def ds_step(ids: torch.Tensor, engine: Any = engine) -> torch.Tensor:
            loss = engine(ids[:, :-1], labels=ids[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            return loss

        times, loss = timed_steps(ds_step, batches, device, s.warmup, s.steps, "deepspeed", progress)
    ds = stats(times, loss, model, mem)
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, model, batches
    release_memory(device)
    if owns_group:
        torch.distributed.destroy_process_group()

    return {
        "mode": "engine",
        "device": device_name(device),
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
        "versions": software_versions(),
        "plain": plain,
        "deepspeed": ds,
        "deepspeed_over_plain_tokens_per_s": ds["tokens_per_s"] / plain["tokens_per_s"],
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
    verdict = "meets" if ratio >= result["target"] else "below"
    return "\n".join(
        [
            f"engine: {result['preset']} ({result['pe']}), seq_len {result['seq_len']}, batch {result['batch']}, "
            f"{result['dtype']}, 1 rank, {result['steps']} steps after {result['warmup']} warmup, {result['device']}",
            format_table(headers, rows),
            f"DeepSpeed / plain tokens/s: {ratio:.3f} ({verdict} target ≥ {result['target']:.2f})",
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
