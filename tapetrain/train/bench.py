"""Performance benchmarks behind `tools/benchmark.py` (DESIGN §5). Measurements only, never pass/fail.

  attention  fused-attention micro-benchmark: RoPE attention (q, k, v) vs TAPE attention (values V plus the
             positional stream E) per backend and sequence length; forward and forward+backward.
  train      optimizer steps of TAPE and its RoPE twin (same preset, same everything but `pe`) in one process:
             tokens/s, step time, MFU, peak memory.
  engine     DeepSpeed overhead: a one-rank DeepSpeed engine vs a plain PyTorch loop doing the same arithmetic.
  data       delegates to `tools/bench_data.py` when it exists.

Timing: CUDA events (attention) or `torch.cuda.synchronize` + perf_counter around whole steps (train, engine);
perf_counter on CPU. Reported times are medians over the timed iterations/steps (robust to interference on a
shared machine; on a dedicated GPU median ≈ mean), and tokens/s = tokens per step / median step time; the JSON
also holds the mean and every step time.

Peak memory (`peak_mem_gb`, GiB): on CUDA `torch.cuda.max_memory_allocated` over the whole measurement (model,
optimizer state and activations), reset before each model is built. On CPU (Linux) the peak resident set of the
process during the measurement (VmHWM, reset through /proc/self/clear_refs) minus the resident set just before
the model was built, i.e. the host memory the model, optimizer and activations added; `null` where /proc does
not allow that. `peak_mem_kind` in the JSON says which of the two a number is.

Low-precision training (bf16/fp16): the module is cast to that dtype, as DeepSpeed's bf16 engine does, and the
plain loops keep fp32 master weights for AdamW (grads upcast, clipped and applied in fp32, weights copied back),
again as DeepSpeed does, so that `train` and `engine` time the arithmetic a real run performs.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import inspect
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tapetrain.model import POSITIONAL_ENCODINGS, Transformer, estimate_mfu, preset_config
from tapetrain.model.attention import attention, backend_available, expand_heads
from tapetrain.train.metrics import device_peak_flops

log = logging.getLogger("tapetrain.bench")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GIB = 2**30

# Backend labels of the attention micro-benchmark. "flash" is RoPE on flash-attn; TAPE on flash-attn has two
# exact strategies (tapetrain.kernels.flash), measured separately.
ROPE_BACKENDS = ("sdpa", "flash")
TAPE_BACKENDS = ("eager", "sdpa", "triton", "flash:two_calls", "flash:padded")
ATTENTION_BACKENDS = ("eager", "sdpa", "triton", "flash", "flash:two_calls", "flash:padded")

ENGINE_TARGET = 0.9  # DeepSpeed tokens/s over plain PyTorch (DESIGN §5 asks for small framework overhead)


# ---------------------------------------------------------------------------------------------------------------
# Device, dtype, timing, memory
# ---------------------------------------------------------------------------------------------------------------


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


def software_versions() -> dict[str, str | None]:
    from importlib import metadata  # not importing the packages: deepspeed alone costs seconds and logs

    versions: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("deepspeed", "triton", "flash-attn"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def warm_up_process(device: torch.device, dtype: torch.dtype) -> None:
    """One throwaway training step of a tiny model: pays one-time costs (thread pools, kernel libraries, the CUDA
    context and cuBLAS workspace) before anything is timed or its memory measured, so the first PE measured is
    not penalised."""
    model = Transformer(preset_config("tiny", max_seq_len=16)).to(device=device, dtype=dtype)
    ids = torch.randint(model.cfg.vocab_size, (1, 17), device=device)
    _plain_step(model, PlainOptimizer(model))(ids)
    synchronize(device)
    del model
    release_memory(device)


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
    """Peak memory of a `with` block in GiB (see the module docstring); `.gb` is None where unmeasurable."""

    def __init__(self, device: torch.device):
        self.device = device
        self.gb: float | None = None
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "host_rss_delta"
        self._base_kib: int | None = None

    def __enter__(self) -> PeakMemory:
        release_memory(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux ≥ 4.0)
                self._base_kib = _proc_status_kib("VmRSS")
            except OSError:
                self._base_kib = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.gb = torch.cuda.max_memory_allocated(self.device) / GIB
        elif self._base_kib is not None:
            peak = _proc_status_kib("VmHWM")
            self.gb = (peak - self._base_kib) / 2**20 if peak is not None else None


# ---------------------------------------------------------------------------------------------------------------
# Output: tables, JSON, plots
# ---------------------------------------------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table (numbers right-aligned)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values: Sequence[str], numeric: Sequence[bool]) -> str:
        padded = (v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric, strict=True))
        return "  ".join(padded).rstrip()

    numeric = [all(_is_number(row[i]) for row in rows) and bool(rows) for i in range(len(headers))]
    out = [line(list(headers), numeric), line(["-" * w for w in widths], numeric)]
    out += [line(r, numeric) for r in cells]
    return "\n".join(out)


def _is_number(value: Any) -> bool:
    return value is None or isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value: Any) -> str:
    if value is None or isinstance(value, float) and not math.isfinite(value):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e3 else f"{value:,.0f}"
    return str(value)


def _fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _json_safe(obj: Any) -> Any:
    """NaN/inf -> null (strict JSON), tuples -> lists."""
    if isinstance(obj, float):
        return _finite_or_none(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json_atomic(path: str | Path, obj: dict) -> Path:
    """Write `obj` as JSON via a temp file in the same directory and os.replace (readers never see half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(_json_safe(obj), indent=2, allow_nan=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _save_figure(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless: benchmarks run on servers
    import matplotlib.pyplot as plt

    return plt


def _title_suffix(result: dict) -> str:
    return f"{result['device']}, {result['dtype']}"


def plot_attention(result: dict, path: str | Path) -> Path:
    """Time vs sequence length per (pe, backend): forward and forward+backward side by side, log-log."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[str, list[dict]] = {}
    for row in result["results"]:
        if row.get("fwd_bwd_ms") is not None:
            series.setdefault(f"{row['pe']} · {row['backend']}", []).append(row)
    for ax, key, title in ((axes[0], "fwd_ms", "forward"), (axes[1], "fwd_bwd_ms", "forward + backward")):
        for label, rows in series.items():
            rows = sorted((r for r in rows if r.get(key) is not None), key=lambda r: r["seq_len"])
            style = "--" if label.startswith("rope") else "-"
            ax.plot([r["seq_len"] for r in rows], [r[key] for r in rows], style, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(result["seq_lens"], [str(t) for t in result["seq_lens"]])
        plain = FuncFormatter(lambda value, _pos: f"{value:g}")  # 3, 10 rather than 3×10⁰, 10¹
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("ms (median)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=8)
    shape = f"B={result['batch']} H={result['heads']} D={result['head_dim']}"
    fig.suptitle(f"TAPE vs RoPE attention ({shape}; {_title_suffix(result)})")
    out = _save_figure(fig, path)
    plt.close(fig)
    return out


def _bar_chart(labels: list[str], values: list[float], title: str, path: str | Path, ylabel: str) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(labels) + 2), 4))
    bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    out = _save_figure(fig, path)
    plt.close(fig)
    return out


def plot_train(result: dict, path: str | Path) -> Path:
    """Bar chart of training tokens/s per positional encoding."""
    pes = [pe for pe in result["pe_list"] if result[pe].get("tokens_per_s") is not None]
    title = (
        f"training throughput: {result['preset']}, seq {result['seq_len']}, batch {result['batch']}\n"
        f"({_title_suffix(result)})"
    )
    return _bar_chart(pes, [result[pe]["tokens_per_s"] for pe in pes], title, path, "tokens/s")


def plot_engine(result: dict, path: str | Path) -> Path:
    """Bar chart: plain PyTorch loop vs DeepSpeed engine tokens/s."""
    labels = ["plain PyTorch", f"DeepSpeed ZeRO-{result['zero_stage']}"]
    values = [result["plain"]["tokens_per_s"], result["deepspeed"]["tokens_per_s"]]
    title = (
        f"DeepSpeed overhead: {result['preset']} ({result['pe']}), seq {result['seq_len']}, batch {result['batch']}"
        f"\n({_title_suffix(result)})"
    )
    return _bar_chart(labels, values, title, path, "tokens/s")


# ---------------------------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionCase:
    pe: str  # "rope": q, k, v | "tape": values V plus the positional stream E (one softmax)
    backend: str  # a label from ATTENTION_BACKENDS
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def _flash_strategy(strategy: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    def run(q, k, v, e=None, *, causal=True):
        from tapetrain.kernels.flash import flash_tape_attention  # lazy: needs flash-attn

        return flash_tape_attention(q, k, v, e, causal=causal, strategy=strategy)

    return run


def _via_dispatch(backend: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    def run(q, k, v, e=None, *, causal=True):
        return attention(q, k, v, e, causal=causal, backend=backend)

    return run


def attention_cases(
    device: torch.device, dtype: torch.dtype, backends: Sequence[str] | None = None
) -> tuple[list[AttentionCase], list[str]]:
    """The (pe, backend) pairs that can run here, filtered by `backends` (a family name like "flash" selects
    all its variants); returns (cases, notes explaining what was skipped)."""
    if backends:
        unknown = sorted(set(backends) - set(ATTENTION_BACKENDS))
        if unknown:
            raise ValueError(f"--backends: unknown {', '.join(unknown)}; choose from {', '.join(ATTENTION_BACKENDS)}")
    notes: list[str] = []
    flash_ok = backend_available("flash", device)
    if flash_ok and dtype == torch.float32:
        flash_ok = False
        notes.append("flash-attn needs fp16/bf16: flash backends skipped for fp32")
    elif not flash_ok:
        notes.append("flash-attn not installed or no CUDA: flash backends skipped")
    triton_ok = backend_available("triton", device)
    if device.type != "cuda":
        if triton_ok:
            notes.append(
                "TRITON_INTERPRET=1: triton runs in the CPU interpreter; its timings are meaningless (correctness only)"
            )
        else:
            notes.append("triton skipped on CPU (set TRITON_INTERPRET=1 to run the interpreter; timings meaningless)")
    elif not triton_ok:
        notes.append("triton not installed: triton backend skipped")

    available = {"eager": True, "sdpa": True, "triton": triton_ok, "flash": flash_ok}
    candidates = [AttentionCase("rope", b, _via_dispatch(b)) for b in ROPE_BACKENDS] + [
        AttentionCase("tape", b, _flash_strategy(b.split(":")[1]) if b.startswith("flash:") else _via_dispatch(b))
        for b in TAPE_BACKENDS
    ]

    def wanted(label: str) -> bool:
        return not backends or label in backends or label.split(":")[0] in backends

    cases = [c for c in candidates if available[c.backend.split(":")[0]] and wanted(c.backend)]
    return cases, notes


def attention_flops(
    batch: int, heads: int, seq_len: int, head_dim: int, value_dim: int, causal: bool = True
) -> tuple[float, float]:
    """(forward, backward) model FLOPs of attention with value width `value_dim` (D for RoPE, 2D for TAPE).

    Forward: QKᵀ over D plus A·[V ‖ E]; backward: recompute QKᵀ, dP and d[V ‖ E] over the value width, dQ and dK
    over D (the flash-attention convention, 2.5× forward for RoPE). Causal attention counts half the pairs.
    """
    pairs = batch * heads * seq_len * seq_len * (0.5 if causal else 1.0)
    return 2 * pairs * (head_dim + value_dim), 2 * pairs * (3 * head_dim + 2 * value_dim)


@dataclass
class AttentionSettings:
    seq_lens: list[int]
    batch: int
    heads: int
    head_dim: int
    kv_heads: int | None = None
    dtype: str = "fp32"
    warmup: int = 2
    iters: int = 5
    backends: list[str] | None = None
    device: str = "auto"
    seed: int = 0


def run_attention_benchmark(s: AttentionSettings, progress: bool = True) -> dict:
    """Times every available (pe, backend) at each sequence length; see the module docstring."""
    device = pick_device(s.device)
    dtype = DTYPES[s.dtype]
    kv_heads = s.kv_heads or s.heads
    if s.heads % kv_heads:
        raise ValueError(f"--heads {s.heads} is not a multiple of --kv-heads {kv_heads}")
    cases, notes = attention_cases(device, dtype, s.backends)
    for note in notes:
        if note.startswith("TRITON_INTERPRET"):
            log.warning(note)  # the others are printed with the table
    if not cases:
        raise RuntimeError(f"no attention backend left to run on {device.type} (notes: {'; '.join(notes)})")
    gen = torch.Generator(device=device).manual_seed(s.seed)
    rows: list[dict] = []
    bar = tqdm(total=len(cases) * len(s.seq_lens), desc="attention", disable=not progress or None, leave=False)
    for t in s.seq_lens:

        def rand(heads: int, gen: torch.Generator = gen, t: int = t) -> torch.Tensor:
            x = torch.randn(s.batch, heads, t, s.head_dim, generator=gen, device=device, dtype=torch.float32)
            return x.to(dtype).requires_grad_(True)

        # Shapes as inside the model: TAPE keys are expanded to query heads (E is per query head), values are not.
        q, k, v, e = rand(s.heads), rand(kv_heads), rand(kv_heads), rand(s.heads)
        k_tape = expand_heads(k.detach(), s.heads).requires_grad_(True)
        grad_o = torch.randn_like(q)
        for case in cases:
            bar.set_postfix_str(f"T={t} {case.pe}/{case.backend}")
            inputs = (q, k, v, None) if case.pe == "rope" else (q, k_tape, v, e)
            row = _time_attention_case(case, inputs, grad_o, device, s, t)
            if case.backend == "triton" and device.type != "cuda":
                row["interpreted"] = True  # kept out of the TAPE/RoPE ratio
            rows.append(row)
            bar.update()
        del q, k, v, e, k_tape, grad_o
        release_memory(device)
    bar.close()

    ratios = []
    for t in s.seq_lens:
        best: dict[str, dict] = {}
        for row in rows:
            if row["seq_len"] == t and row.get("fwd_bwd_ms") is not None and not row.get("interpreted"):
                if row["pe"] not in best or row["fwd_bwd_ms"] < best[row["pe"]]["fwd_bwd_ms"]:
                    best[row["pe"]] = row
        if "tape" in best and "rope" in best:
            ratios.append(
                {
                    "seq_len": t,
                    "tape_backend": best["tape"]["backend"],
                    "rope_backend": best["rope"]["backend"],
                    "ratio": best["tape"]["fwd_bwd_ms"] / best["rope"]["fwd_bwd_ms"],
                }
            )
    return {
        "mode": "attention",
        "device": device_name(device),
        "dtype": s.dtype,
        "batch": s.batch,
        "heads": s.heads,
        "kv_heads": kv_heads,
        "head_dim": s.head_dim,
        "causal": True,
        "seq_lens": list(s.seq_lens),
        "warmup": s.warmup,
        "iters": s.iters,
        "timing": "median; CUDA events" if device.type == "cuda" else "median; perf_counter",
        "notes": notes,
        "versions": software_versions(),
        "results": rows,
        "tape_over_rope_fwd_bwd": ratios,
    }


def _time_attention_case(
    case: AttentionCase,
    inputs: tuple[torch.Tensor, ...],
    grad_o: torch.Tensor,
    device: torch.device,
    s: AttentionSettings,
    seq_len: int,
) -> dict:
    q, k, v, e = inputs
    leaves = [x for x in (q, k, v, e) if x is not None]
    value_dim = s.head_dim * (2 if e is not None else 1)
    fwd_flops, bwd_flops = attention_flops(s.batch, s.heads, seq_len, s.head_dim, value_dim)
    row: dict[str, Any] = {"seq_len": seq_len, "pe": case.pe, "backend": case.backend}

    def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
        return case.fn(q, k, v, e, causal=True)  # grad mode on: the forward as it runs in training

    def forward_backward() -> None:
        out, out_e = forward()
        outputs, grads = [out], [grad_o]
        if out_e is not None:
            outputs.append(out_e)
            grads.append(grad_o)
        torch.autograd.grad(outputs, leaves, grads)  # returns the grads; nothing accumulates in .grad

    try:
        fwd = statistics.median(time_call(forward, device, s.warmup, s.iters))
        if device.type == "cuda":
            release_memory(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        both = statistics.median(time_call(forward_backward, device, s.warmup, s.iters))
        if device.type == "cuda":
            row["fwd_bwd_extra_mem_gb"] = (torch.cuda.max_memory_allocated(device) - base) / GIB
    except Exception as err:  # one backend failing (OOM, unsupported shape) must not lose the others' results
        message = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        log.warning("attention %s/%s at T=%d failed: %s", case.pe, case.backend, seq_len, message)
        row["error"] = f"{type(err).__name__}: {message}"
        release_memory(device)
        return row
    row.update(
        fwd_ms=fwd * 1e3,
        fwd_bwd_ms=both * 1e3,
        fwd_tflops=fwd_flops / fwd / 1e12,
        fwd_bwd_tflops=(fwd_flops + bwd_flops) / both / 1e12,
    )
    return row


def attention_report(result: dict) -> str:
    on_cuda = any("fwd_bwd_extra_mem_gb" in r for r in result["results"])
    rates = [r["fwd_bwd_tflops"] for r in result["results"] if r.get("fwd_bwd_tflops") is not None]
    unit, scale = ("TFLOP/s", 1.0) if rates and max(rates) >= 1 else ("GFLOP/s", 1e3)  # readable on CPU too
    headers = ["seq_len", "pe", "backend", "fwd ms", "fwd+bwd ms", f"fwd+bwd {unit}"]
    headers += ["fwd+bwd extra mem GB"] if on_cuda else []
    rows = []
    for r in result["results"]:
        rate = r["fwd_bwd_tflops"] * scale if r.get("fwd_bwd_tflops") is not None else None
        row = [r["seq_len"], r["pe"], r["backend"], r.get("fwd_ms"), r.get("fwd_bwd_ms"), rate]
        rows.append(row + ([r.get("fwd_bwd_extra_mem_gb")] if on_cuda else []))
    lines = [
        f"attention: {result['device']}, {result['dtype']}, batch {result['batch']}, heads {result['heads']} "
        f"(kv {result['kv_heads']}), head_dim {result['head_dim']}, causal; median of {result['iters']} "
        f"after {result['warmup']} warmup",
        format_table(headers, rows),
    ]
    errors = [r for r in result["results"] if "error" in r]
    lines += [f"  failed: T={r['seq_len']} {r['pe']}/{r['backend']}: {r['error']}" for r in errors]
    if result["tape_over_rope_fwd_bwd"]:
        lines.append("TAPE / RoPE fwd+bwd time (best backend each; target ≤ 1.5):")
        lines += [
            f"  T={r['seq_len']}: {r['ratio']:.2f}  (tape {r['tape_backend']} vs rope {r['rope_backend']})"
            for r in result["tape_over_rope_fwd_bwd"]
        ]
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Models, optimizers and timed steps (train, engine)
# ---------------------------------------------------------------------------------------------------------------


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """["d_model=1024", "n_layers=24"] -> {"d_model": 1024, "n_layers": 24} (values parsed as YAML scalars)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with a model config key, e.g. --set n_layers=24")
        out[key.strip()] = yaml.safe_load(value)
    return out


def build_model(
    preset: str,
    pe: str,
    seq_len: int,
    *,
    backend: str = "auto",
    activation_checkpointing: bool = False,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
) -> Transformer:
    """The preset with `pe` swapped in; the same seed gives every PE the same shared weights."""
    cfg = preset_config(
        preset,
        **{
            "max_seq_len": seq_len,  # the training context (randpe and friends derive their ranges from it)
            **(overrides or {}),
            "pe": pe,
            "attn_backend": backend,
            "activation_checkpointing": activation_checkpointing,
        },
    )
    torch.manual_seed(seed)
    return Transformer(cfg)


def _adamw(params: Iterator[torch.nn.Parameter] | list[torch.Tensor], fused: bool = False) -> torch.optim.AdamW:
    """fused: torch's single-kernel AdamW (CUDA), as a tuned training loop would use."""
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused or None)


class PlainOptimizer:
    """torch AdamW + global-norm clipping. For low-precision modules it keeps fp32 master weights (grads upcast,
    clipped and applied in fp32, weights copied back) — the arithmetic of DeepSpeed's bf16 engine."""

    def __init__(self, model: torch.nn.Module, clip: float = 1.0):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.clip = clip
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        self.master = [p.detach().float().clone() for p in self.params] if self.mixed else self.params
        self.opt = _adamw(self.master, fused=all(p.is_cuda for p in self.params))

    def step(self) -> None:
        if self.mixed:
            for p, m in zip(self.params, self.master, strict=True):
                m.grad = p.grad.float() if p.grad is not None else None
                p.grad = None
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.master, self.clip, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)


def random_batches(vocab_size: int, batch: int, seq_len: int, device: torch.device, n: int, seed: int) -> list:
    """`n` random (batch, seq_len + 1) token batches, made up front so the timed steps do no data work."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randint(vocab_size, (batch, seq_len + 1), generator=gen, device=device) for _ in range(n)]


@dataclass
class StepResult:
    step_times: list[float]
    tokens_per_step: int
    flops_per_token: float
    peak_flops: float
    params: int
    final_loss: float
    peak_mem_gb: float | None
    peak_mem_kind: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        step_s = statistics.median(self.step_times)
        tokens_per_s = self.tokens_per_step / step_s
        return {
            "tokens_per_s": tokens_per_s,
            "step_s": step_s,
            "step_s_mean": statistics.fmean(self.step_times),
            "mfu": _finite_or_none(estimate_mfu(self.flops_per_token, tokens_per_s, self.peak_flops)),
            "peak_mem_gb": self.peak_mem_gb,
            "peak_mem_kind": self.peak_mem_kind,
            "params": self.params,
            "flops_per_token": self.flops_per_token,
            "final_loss": self.final_loss,
            "step_times_s": self.step_times,
            **self.extra,
        }


def timed_steps(
    step: Callable[[torch.Tensor], torch.Tensor],
    batches: list[torch.Tensor],
    device: torch.device,
    warmup: int,
    steps: int,
    desc: str,
    progress: bool = True,
) -> tuple[list[float], float]:
    """Runs warmup + steps optimizer steps (`step(batch) -> loss`), synchronising around each one; returns
    (seconds of each timed step, last loss)."""
    times: list[float] = []
    loss = torch.tensor(math.nan)
    for i in tqdm(range(warmup + steps), desc=desc, disable=not progress or None, leave=False):
        synchronize(device)
        t0 = time.perf_counter()
        loss = step(batches[i % len(batches)])
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, float(loss.detach().float())


def _plain_step(model: torch.nn.Module, opt: PlainOptimizer) -> Callable[[torch.Tensor], torch.Tensor]:
    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        opt.step()
        return loss

    return step


# ---------------------------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------------------------


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
        "peak_flops": _finite_or_none(peak),
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
            times, loss = timed_steps(_plain_step(model, opt), batches, device, s.warmup, s.steps, pe, progress)
        result[pe] = StepResult(
            step_times=times,
            tokens_per_step=s.batch * s.seq_len,
            flops_per_token=model.flops_per_token(s.seq_len),
            peak_flops=peak,
            params=model.num_params(),
            final_loss=loss,
            peak_mem_gb=mem.gb,
            peak_mem_kind=mem.kind,
        ).to_dict()
        del model, opt, batches
        release_memory(device)
    has_both = "tape" in result and "rope" in result
    result["tape_over_rope_step_time"] = result["tape"]["step_s"] / result["rope"]["step_s"] if has_both else None
    return result


def _noise_warning(results: Sequence[dict]) -> list[str]:
    """A hint when step times swing wildly: another process competes for the CPU (OpenMP threads then stall)."""
    spreads = [max(r["step_times_s"]) / min(r["step_times_s"]) for r in results if r.get("step_times_s")]
    if spreads and max(spreads) > 3:
        return [
            f"warning: step times vary up to {max(spreads):.0f}x within a run: the machine is busy; use more --steps "
            "(and --threads 1 on a shared CPU)"
        ]
    return []


def train_report(result: dict) -> str:
    rope = result.get("rope")
    headers = ["pe", "params M", "step s", "tokens/s", "MFU", "peak mem GB", "step time / rope"]
    rows = []
    for pe in result["pe_list"]:
        r = result[pe]
        ratio = r["step_s"] / rope["step_s"] if rope else None
        rows.append(
            [pe, r["params"] / 1e6, r["step_s"], r["tokens_per_s"], _fmt_pct(r["mfu"]), r["peak_mem_gb"], ratio]
        )
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
    lines += _noise_warning([result[pe] for pe in result["pe_list"]])
    kind = result[result["pe_list"][0]]["peak_mem_kind"]
    if kind == "host_rss_delta":
        lines.append("peak mem: host RSS peak above the RSS before the model was built")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# engine
# ---------------------------------------------------------------------------------------------------------------


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

    from tapetrain.train.distributed import init_distributed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-engine INFO banner drowns the table
    owns_group = not torch.distributed.is_initialized()
    env = init_distributed()  # a lone process declares itself rank 0 of 1 on a free port (DESIGN §4)
    if env.world_size != 1:
        raise RuntimeError(f"engine mode measures ONE rank; got WORLD_SIZE={env.world_size}; run it without a launcher")
    device = env.device
    dtype = DTYPES[s.dtype]
    peak = device_peak_flops(device, s.peak_tflops)
    ds_config = engine_ds_config(s)

    def make_model() -> Transformer:
        return build_model(s.preset, s.pe, s.seq_len, backend=s.backend, overrides=s.overrides, seed=s.seed)

    def stats(times: list[float], loss: float, model: Transformer, mem: PeakMemory) -> dict:
        return StepResult(
            step_times=times,
            tokens_per_step=s.batch * s.seq_len,
            flops_per_token=model.flops_per_token(s.seq_len),
            peak_flops=peak,
            params=model.num_params(),
            final_loss=loss,
            peak_mem_gb=mem.gb,
            peak_mem_kind=mem.kind,
        ).to_dict()

    n_batches = min(s.steps + s.warmup, 4)
    warm_up_process(device, dtype)
    with PeakMemory(device) as mem:
        model = make_model().to(device=device, dtype=dtype).train()
        opt = PlainOptimizer(model)
        batches = random_batches(model.cfg.vocab_size, s.batch, s.seq_len, device, n_batches, 1)
        times, loss = timed_steps(_plain_step(model, opt), batches, device, s.warmup, s.steps, "plain", progress)
    plain = stats(times, loss, model, mem)
    del model, opt
    release_memory(device)

    with PeakMemory(device) as mem:
        model = make_model()  # fp32; DeepSpeed casts the module for bf16/fp16 and keeps fp32 master weights
        optimizer = _adamw(model.parameters(), fused=device.type == "cuda")
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
        "peak_flops": _finite_or_none(peak),
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
        [name, r["step_s"], r["tokens_per_s"], _fmt_pct(r["mfu"]), r["peak_mem_gb"], r["final_loss"]]
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
            *_noise_warning([result["plain"], result["deepspeed"]]),
        ]
    )


# ---------------------------------------------------------------------------------------------------------------
# layer: one decoder layer's activation memory, measured vs the memory model
# ---------------------------------------------------------------------------------------------------------------


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
    model.to(device=device, dtype=dtype).train()
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


def run_layer_benchmark(s: LayerSettings, progress: bool = True) -> dict:
    """Per-layer activation bytes = (model with 3 layers) − (model with 2 layers): everything else (embedding,
    logits, the last layer, which updates no state) cancels. Compared with memory.layer_activation_bytes."""
    from tapetrain.train.memory import layer_activation_bytes

    device = pick_device(s.device)
    two = _forward_memory(s, 2, device)
    three = _forward_memory(s, 3, device)
    cfg = three.pop("cfg")
    two.pop("cfg")
    estimate = layer_activation_bytes(cfg, s.batch, s.seq_len, bytes_per_value=DTYPES[s.dtype].itemsize)

    def diff(key: str) -> int | None:
        return None if three[key] is None else three[key] - two[key]

    measured = {key: diff(key) for key in ("after_forward_bytes", "peak_bytes", "saved_bytes")}
    return {
        "mode": "layer",
        "device": device_name(device),
        "preset": s.preset,
        "pe": s.pe,
        "seq_len": s.seq_len,
        "batch": s.batch,
        "dtype": s.dtype,
        "backend": s.backend,
        "versions": software_versions(),
        "runs": [two, three],
        "per_layer_measured_gb": {k: (v / GIB if v is not None else None) for k, v in measured.items()},
        "per_layer_estimate_gb": estimate / GIB,
        "measured_over_estimate": {
            k: (v / estimate if v is not None else None) for k, v in measured.items()
        },
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
            f"memory model (tapetrain.train.memory.layer_activation_bytes): {result['per_layer_estimate_gb']:.3f} GiB",
        ]
    )


def plot_layer(result: dict, path: str | Path) -> Path:
    labels = ["model"] + list(result["per_layer_measured_gb"])
    values = [result["per_layer_estimate_gb"]] + [v or 0.0 for v in result["per_layer_measured_gb"].values()]
    return _bar_chart(labels, values, f"one {result['preset']} layer, {result['seq_len']} tokens" +
                      _title_suffix(result), path, "GiB")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------------


def run_data_benchmark(script: str | Path, argv: Sequence[str]) -> int:
    """Runs `script`'s main (tools/bench_data.py, another module's benchmark) with `argv`; 1 if it is missing."""
    script = Path(script)
    if not script.is_file():
        print(f"data benchmark: {script} is missing (the data-reader / prepare benchmark is not written yet); "
              "nothing was measured")  # fmt: skip
        return 1
    spec = importlib.util.spec_from_file_location("bench_data", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main = getattr(module, "main", None)
    if not callable(main):
        print(f"data benchmark: {script} has no main(); expected main(argv: list[str] | None) -> int | None")
        return 1
    if inspect.signature(main).parameters:
        rc = main(list(argv))
    else:  # an argparse main() reading sys.argv
        saved = sys.argv
        sys.argv = [str(script), *argv]
        try:
            rc = main()
        finally:
            sys.argv = saved
    return int(rc or 0)
