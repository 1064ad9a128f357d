"""`attention` mode: RoPE attention (q, k, v) vs TAPE attention (values V plus the positional stream E) per
backend and sequence length, forward and forward+backward."""

from __future__ import annotations

import argparse
import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tapetrain.atomic_io import save_figure
from tapetrain.bench.arguments import add_report_args, ints, names
from tapetrain.bench.common import DTYPES, GIB, device_name, pick_device, release_memory
from tapetrain.bench.header import report_header
from tapetrain.bench.pairs import MIN_HEADLINE_PAIRS, interleaved_times, pair_ratios, spread
from tapetrain.bench.report import format_table, pyplot, title_suffix
from tapetrain.model.attention import attention, backend_available, expand_heads, sdpa_attention
from tapetrain.progress import progress as progress_bar

log = logging.getLogger("tapetrain.bench")

# Backend labels of the attention micro-benchmark. "flash" is RoPE on flash-attn; TAPE on flash-attn has two
# exact strategies (tapetrain.kernels.flash), measured separately.
ROPE_BACKENDS = ("sdpa", "flash")
# "sdpa" is what the model runs (one [V ‖ E] call, or two on CPU from CPU_TWO_CALLS_FROM_KEYS keys); "sdpa:one_call"
# and "sdpa:two_calls" force one strategy, to measure where the switch belongs.
TAPE_BACKENDS = ("eager", "sdpa", "sdpa:one_call", "sdpa:two_calls", "triton", "flash:two_calls", "flash:padded")
ATTENTION_BACKENDS = ("eager", "sdpa", "sdpa:one_call", "sdpa:two_calls", "triton", "flash", "flash:two_calls",
                      "flash:padded")


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


def _sdpa_strategy(calls: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    def run(q, k, v, e=None, *, causal=True):
        return sdpa_attention(q, k, v, e, causal=causal, value_calls=calls)

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
        AttentionCase("tape", b, _case_fn(b)) for b in TAPE_BACKENDS
    ]

    def wanted(label: str) -> bool:
        return not backends or label in backends or label.split(":")[0] in backends

    cases = [c for c in candidates if available[c.backend.split(":")[0]] and wanted(c.backend)]
    return cases, notes


def _case_fn(label: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    if label.startswith("flash:"):
        return _flash_strategy(label.split(":")[1])
    if label.startswith("sdpa:"):
        return _sdpa_strategy(1 if label == "sdpa:one_call" else 2)
    return _via_dispatch(label)


def attention_flops(
    batch: int, heads: int, seq_len: int, head_dim: int, value_dim: int, causal: bool = True
) -> tuple[float, float]:
    """(forward, backward) model FLOPs of attention with value width `value_dim` (D for RoPE, 2D for TAPE).

    Forward: QKᵀ over D plus A·[V ‖ E]; backward: recompute QKᵀ, dP and d[V ‖ E] over the value width, dQ and dK
    over D (the flash-attention convention, 2.5× forward for RoPE). Causal attention counts half the pairs.
    """
    pairs = batch * heads * seq_len * seq_len * (0.5 if causal else 1.0)
    return 2 * pairs * (head_dim + value_dim), 2 * pairs * (3 * head_dim + 2 * value_dim)


HELP = "fused-attention micro-benchmark: TAPE vs RoPE per backend"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_report_args(p)
    p.add_argument("--seq-lens", type=ints, help="comma-separated (default: 128,256 on CPU; 1024..8192 on CUDA)")
    p.add_argument("--batch", type=int)
    p.add_argument("--heads", type=int, default=12, help="query heads (default 12, the paper's 155M model)")
    p.add_argument("--kv-heads", type=int, help="key/value heads for GQA (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, help="timed rounds, each case once, order rotated (≥ 10 for a headline)")
    p.add_argument("--warmup", type=int, help="untimed iterations first")
    p.add_argument("--backends", type=names,
                   help=f"only these (comma-separated) of {', '.join(ATTENTION_BACKENDS)}; 'flash' selects all flash")


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
    """Every available (pe, backend) at each sequence length, alternated call by call (tapetrain.bench.pairs):
    `warmup` untimed rounds, then `iters` timed rounds of forward calls and `iters` of forward+backward."""
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
    pairs: list[dict] = []
    for t in progress_bar(s.seq_lens, desc="attention", unit="T", disable=not progress, leave=False):

        def rand(heads: int, gen: torch.Generator = gen, t: int = t) -> torch.Tensor:
            x = torch.randn(s.batch, heads, t, s.head_dim, generator=gen, device=device, dtype=torch.float32)
            return x.to(dtype).requires_grad_(True)

        # Shapes as inside the model: TAPE keys are expanded to query heads (E is per query head), values are not.
        q, k, v, e = rand(s.heads), rand(kv_heads), rand(kv_heads), rand(s.heads)
        k_tape = expand_heads(k.detach(), s.heads).requires_grad_(True)
        grad_o = torch.randn_like(q)
        inputs = {c: (q, k, v, None) if c.pe == "rope" else (q, k_tape, v, e) for c in cases}
        at_t = _time_cases(cases, inputs, grad_o, device, s, t)
        rows += at_t
        pairs += _pairs_at(at_t, t)
        del q, k, v, e, k_tape, grad_o
        release_memory(device)
    ratios = [p for p in pairs if p["kind"] == "tape_over_rope"]
    return {
        **report_header("attention", device_name(device)),
        "dtype": s.dtype,
        "batch": s.batch,
        "heads": s.heads,
        "kv_heads": kv_heads,
        "head_dim": s.head_dim,
        "causal": True,
        "seq_lens": list(s.seq_lens),
        "warmup": s.warmup,
        "iters": s.iters,
        "pairs": s.iters,
        "headline": s.iters >= MIN_HEADLINE_PAIRS,
        "min_headline_pairs": MIN_HEADLINE_PAIRS,
        "timing": ("cases alternated call by call, order rotated each round; median and spread over rounds; "
                   + ("CUDA events" if device.type == "cuda" else "perf_counter")),
        "notes": notes,
        "results": rows,
        "tape_over_rope_fwd_bwd": ratios,
        "pair_ratios": pairs,
    }


def _time_cases(cases: list[AttentionCase], inputs: dict, grad_o: torch.Tensor, device: torch.device,
                s: AttentionSettings, seq_len: int) -> list[dict]:  # fmt: skip
    """One row per case; a case that fails (OOM, unsupported shape) gets an error row, the others still run."""
    rows: dict[AttentionCase, dict[str, Any]] = {c: {"seq_len": seq_len, "pe": c.pe, "backend": c.backend}
                                                 for c in cases}  # fmt: skip
    forwards, both = {}, {}
    for case in cases:
        q, k, v, e = inputs[case]
        leaves = [x for x in (q, k, v, e) if x is not None]

        def forward(case=case, q=q, k=k, v=v, e=e) -> tuple[torch.Tensor, torch.Tensor | None]:
            return case.fn(q, k, v, e, causal=True)  # grad mode on: the forward as it runs in training

        def forward_backward(forward=forward, leaves=leaves) -> None:
            out, out_e = forward()
            outputs, grads = [out], [grad_o]
            if out_e is not None:
                outputs.append(out_e)
                grads.append(grad_o)
            torch.autograd.grad(outputs, leaves, grads)  # returns the grads; nothing accumulates in .grad

        try:  # one call each first: a case that cannot run is reported and left out of the rounds
            forward_backward()
        except Exception as err:  # noqa: BLE001 - one backend failing must not lose the others' results
            message = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
            log.warning("attention %s/%s at T=%d failed: %s", case.pe, case.backend, seq_len, message)
            rows[case]["error"] = f"{type(err).__name__}: {message}"
            release_memory(device)
            continue
        forwards[case], both[case] = forward, forward_backward
    fwd_times = interleaved_times(forwards, device, s.warmup, s.iters)
    both_times = interleaved_times(both, device, s.warmup, s.iters)
    for case in both:
        q, k, v, e = inputs[case]
        value_dim = s.head_dim * (2 if e is not None else 1)
        fwd_flops, bwd_flops = attention_flops(s.batch, s.heads, seq_len, s.head_dim, value_dim)
        fwd, fb = statistics.median(fwd_times[case]), statistics.median(both_times[case])
        rows[case].update(
            fwd_ms=fwd * 1e3,
            fwd_bwd_ms=fb * 1e3,
            fwd_bwd_ms_spread={k: v * 1e3 for k, v in spread(both_times[case]).items()},
            fwd_bwd_ms_per_round=[x * 1e3 for x in both_times[case]],
            fwd_tflops=fwd_flops / fwd / 1e12,
            fwd_bwd_tflops=(fwd_flops + bwd_flops) / fb / 1e12,
        )
        if case.backend == "triton" and device.type != "cuda":
            rows[case]["interpreted"] = True  # kept out of the TAPE/RoPE ratio
        if device.type == "cuda":
            release_memory(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            both[case]()
            rows[case]["fwd_bwd_extra_mem_gb"] = (torch.cuda.max_memory_allocated(device) - base) / GIB
    return list(rows.values())


def _pairs_at(rows: list[dict], seq_len: int) -> list[dict]:
    """Per-round ratios at one length: TAPE's best backend over RoPE's best (by median), and TAPE's two SDPA
    strategies against each other when both ran."""
    timed = [r for r in rows if r.get("fwd_bwd_ms") is not None and not r.get("interpreted")]
    best: dict[str, dict] = {}
    for row in timed:
        if row["pe"] not in best or row["fwd_bwd_ms"] < best[row["pe"]]["fwd_bwd_ms"]:
            best[row["pe"]] = row
    out = []
    if "tape" in best and "rope" in best:
        ratio = pair_ratios(best["tape"]["fwd_bwd_ms_per_round"], best["rope"]["fwd_bwd_ms_per_round"])
        out.append({"kind": "tape_over_rope", "seq_len": seq_len, "tape_backend": best["tape"]["backend"],
                    "rope_backend": best["rope"]["backend"], "ratio": ratio["median"], "spread": ratio})  # fmt: skip
    by_backend = {r["backend"]: r for r in timed if r["pe"] == "tape"}
    if "sdpa:two_calls" in by_backend and "sdpa:one_call" in by_backend:
        ratio = pair_ratios(by_backend["sdpa:two_calls"]["fwd_bwd_ms_per_round"],
                            by_backend["sdpa:one_call"]["fwd_bwd_ms_per_round"])  # fmt: skip
        out.append({"kind": "sdpa_two_calls_over_one_call", "seq_len": seq_len, "ratio": ratio["median"],
                    "spread": ratio})  # fmt: skip
    return out


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
        f"(kv {result['kv_heads']}), head_dim {result['head_dim']}, causal; median of {result['iters']} rounds "
        f"(cases alternated) after {result['warmup']} warmup",
        format_table(headers, rows),
    ]
    errors = [r for r in result["results"] if "error" in r]
    lines += [f"  failed: T={r['seq_len']} {r['pe']}/{r['backend']}: {r['error']}" for r in errors]
    if result["tape_over_rope_fwd_bwd"]:
        lines.append("TAPE / RoPE fwd+bwd time, per-round ratio (best backend each; target ≤ 1.5):")
        lines += [
            f"  T={r['seq_len']}: {r['ratio']:.2f} (IQR {r['spread']['q1']:.2f}–{r['spread']['q3']:.2f}, "
            f"{r['spread']['pairs']} pairs)  (tape {r['tape_backend']} vs rope {r['rope_backend']})"
            for r in result["tape_over_rope_fwd_bwd"]
        ]
    split = [p for p in result.get("pair_ratios", []) if p["kind"] == "sdpa_two_calls_over_one_call"]
    if split:
        lines.append("TAPE on SDPA, two calls (V, E) / one [V ‖ E] call, fwd+bwd per-round ratio:")
        lines += [f"  T={p['seq_len']}: {p['ratio']:.2f} (IQR {p['spread']['q1']:.2f}–{p['spread']['q3']:.2f}, "
                  f"{p['spread']['pairs']} pairs)" for p in split]  # fmt: skip
    if not result.get("headline", True):
        lines.append(f"not a headline: fewer than {result['min_headline_pairs']} pairs (--iters)")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)


def plot_attention(result: dict, path: str | Path) -> Path:
    """Time vs sequence length per (pe, backend): forward and forward+backward side by side, log-log."""
    plt = pyplot()
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
    fig.suptitle(f"TAPE vs RoPE attention ({shape}; {title_suffix(result)})")
    out = save_figure(fig, path)
    plt.close(fig)
    return out
