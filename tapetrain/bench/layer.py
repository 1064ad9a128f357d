"""`layer` mode: one decoder layer's activation memory, measured as (3 layers) − (2 layers), vs the memory model."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tapetrain.bench.arguments import add_model_args, add_report_args
from tapetrain.bench.common import DTYPES, GIB, device_name, pick_device, release_memory, synchronize
from tapetrain.bench.header import report_header
from tapetrain.bench.report import bar_chart, format_table, title_suffix
from tapetrain.bench.steps import build_model, random_batches
from tapetrain.model.execution_plan import place_model

if TYPE_CHECKING:
    from tapetrain.model.config import ModelConfig


HELP = "one decoder layer's activation memory, measured vs the memory model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_report_args(p)
    add_model_args(p, seq_len="the preset's max_seq_len", batch=1)
    p.add_argument("--pe", default="tape")


@dataclass
class LayerSettings:
    preset: str
    seq_len: int
    batch: int = 1
    pe: str = "tape"
    dtype: str = "bf16"
    backend: str = "auto"
    overrides: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"
    seed: int = 0


def _forward_memory(s: LayerSettings, n_layers: int, device: torch.device) -> dict[str, Any]:
    """Bytes a training forward leaves allocated (what backward will consume) and the fwd+bwd peak, both above
    the weights, for the preset cut to `n_layers` layers."""
    from tapetrain.train.memory import measure_saved_activation_bytes

    dtype = DTYPES[s.dtype]
    model = build_model(s.preset, s.pe, s.seq_len, backend=s.backend,
                        overrides={**s.overrides, "n_layers": n_layers}, seed=s.seed)  # fmt: skip
    place_model(model, device, dtype).train()
    ids = random_batches(model.cfg.vocab_size, s.batch, s.seq_len, device, 1, s.seed)[0]
    release_memory(device)
    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    out = model(ids[:, :-1], labels=ids[:, 1:])
    after_forward = (torch.cuda.memory_allocated(device) - base) if cuda else None
    out.loss.backward()
    synchronize(device)
    peak = (torch.cuda.max_memory_allocated(device) - base) if cuda else None
    del out
    model.zero_grad(set_to_none=True)
    saved = measure_saved_activation_bytes(model, ids)
    cfg = model.cfg
    del model, ids
    release_memory(device)
    return {"n_layers": n_layers, "after_forward_bytes": after_forward, "peak_bytes": peak, "saved_bytes": saved,
            "cfg": cfg}  # fmt: skip


def _attention_that_ran(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seq: int) -> tuple[str, str]:
    """(backend, path): the backend the execution plan gives the measured layer (layer 1 of 3, which carries
    TAPE's E) on this device, and the path memory.layer_activation_bytes models for it."""
    from tapetrain.model.execution_plan import resolve_plan
    from tapetrain.train.memory import attention_path

    layer = resolve_plan(cfg, device, dtype).layers[1]
    backend = layer.attention.plain
    return backend, attention_path(backend, device.type, seq, layer.carries_e)


def run_layer_benchmark(s: LayerSettings, progress: bool = True) -> dict:
    """Per-layer activation bytes = (model with 3 layers) − (model with 2 layers): everything else (embedding,
    logits, the first layer, whose TAPE state needs no gradient, and the last, which updates no state) cancels.
    Compared with memory.layer_activation_bytes for the attention path that ran."""
    from tapetrain.model.tiling import tile_count
    from tapetrain.train.memory import layer_activation_bytes, tiled_mlp_peak_bytes

    device = pick_device(s.device)
    two = _forward_memory(s, 2, device)
    three = _forward_memory(s, 3, device)
    cfg = three.pop("cfg")
    two.pop("cfg")
    value_bytes = DTYPES[s.dtype].itemsize
    chunks = tile_count(cfg.tiled_mlp, s.seq_len, cfg.d_model)  # model.tiled_mlp as the model resolves it
    backend, path = _attention_that_ran(cfg, device, DTYPES[s.dtype], s.seq_len)
    estimate = layer_activation_bytes(cfg, s.batch, s.seq_len, value_bytes, cfg.updates_tape_state(1), chunks,
                                      attention=path)  # fmt: skip

    def diff(key: str) -> int | None:
        return None if three[key] is None else three[key] - two[key]

    measured = {key: diff(key) for key in ("after_forward_bytes", "peak_bytes", "saved_bytes")}
    return {
        **report_header("layer", device_name(device)),
        "preset": s.preset,
        "pe": s.pe,
        "seq_len": s.seq_len,
        "batch": s.batch,
        "dtype": s.dtype,
        "backend": s.backend,
        "attention_backend": backend,
        "attention_path": path,
        "tiled_mlp_chunks": chunks,
        "tiled_mlp_recompute_peak_gb": tiled_mlp_peak_bytes(cfg, s.batch, s.seq_len, chunks, value_bytes) / GIB,
        "runs": [two, three],
        "per_layer_measured_gb": {k: (v / GIB if v is not None else None) for k, v in measured.items()},
        "per_layer_estimate_gb": estimate / GIB,
        "measured_over_estimate": {k: (v / estimate if v is not None else None) for k, v in measured.items()},
    }


def layer_report(result: dict) -> str:
    rows = [
        [key.replace("_bytes", ""), gb, result["measured_over_estimate"][key]]
        for key, gb in result["per_layer_measured_gb"].items()
    ]
    return "\n".join(
        [
            f"layer: {result['preset']} ({result['pe']}), {result['batch']} × {result['seq_len']} tokens, "
            f"{result['dtype']}, {result['device']}; one decoder layer = (3 layers) − (2 layers)",
            format_table(["measured", "GiB per layer", "measured / model"], rows),
            f"memory model (tapetrain.train.memory.layer_activation_bytes, attention {result.get('attention_path')}):"
            f" {result['per_layer_estimate_gb']:.3f} GiB",
        ]
    )


def plot_layer(result: dict, path: str | Path) -> Path:
    labels = ["model"] + list(result["per_layer_measured_gb"])
    values = [result["per_layer_estimate_gb"]] + [v or 0.0 for v in result["per_layer_measured_gb"].values()]
    return bar_chart(labels, values, f"one {result['preset']} layer, {result['seq_len']} tokens" +
                      title_suffix(result), path, "GiB")  # fmt: skip
