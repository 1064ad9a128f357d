"""`docmask` mode: the training step with and without the document mask (data.document_mask), one process.

Two models with identical initial weights, each with its own AdamW (tapetrain.bench.steps.PlainOptimizer), train
on the same packed batch: one as today (causal attention over the whole row, positions 0..T−1), one given doc_ids
(`--docs` documents per row, lengths drawn once from the seed: positions restart per document, attention stays
inside each). The two variants are alternated step by step, the order rotated each round, after warm-up rounds;
a pair is one round's two steps and its ratio is step time with the mask / without. A step is forward + backward
+ optimizer step. The attention backends that actually ran are read from the model's log of its choices.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tapetrain.atomic_io import save_figure
from tapetrain.bench.arguments import add_model_args, add_report_args, add_rounds_args
from tapetrain.bench.common import DTYPES, device_name, pick_device
from tapetrain.bench.header import report_header
from tapetrain.bench.pairs import MAX_WARMUP_ROUNDS, MIN_HEADLINE_PAIRS, pairs_header, spread
from tapetrain.bench.report import format_table, pyplot
from tapetrain.bench.steps import PlainOptimizer, build_model, interleaved_steps, random_batches, steady_warmup
from tapetrain.model.execution_plan import place_model

VARIANTS = ("no_mask", "mask")


HELP = "training step with vs without the document mask, alternated in one process"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_report_args(p)
    add_model_args(p, seq_len=1024, batch=1)
    p.add_argument("--docs", type=int, default=8, help="documents per row, random lengths (default 8)")
    add_rounds_args(p, "timed rounds of one step per variant")
    p.add_argument("--max-warmup", type=int, default=MAX_WARMUP_ROUNDS,
                   help="warm-up goes past --warmup until the mask / no-mask ratio is steady (the last 3 rounds within "
                        f"5%% of their median), at most this many rounds (default {MAX_WARMUP_ROUNDS})")
    p.add_argument("--pe", default="tape", help="positional encoding (default tape)")


@dataclass
class DocmaskSettings:
    preset: str = "tiny"
    seq_len: int = 1024
    batch: int = 1
    docs: int = 8  # documents per row
    pairs: int = MIN_HEADLINE_PAIRS
    warmup: int = 2  # untimed rounds first, at least; more until the ratio is steady (bench.pairs.is_steady)
    max_warmup: int = MAX_WARMUP_ROUNDS
    dtype: str = "fp32"
    pe: str = "tape"
    backend: str = "auto"
    overrides: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    allow_few_pairs: bool = False  # tests: fewer pairs than MIN_HEADLINE_PAIRS, the JSON is then no headline
    seed: int = 0


def check_settings(s: DocmaskSettings) -> None:
    if s.pairs < 1 or s.pairs < MIN_HEADLINE_PAIRS and not s.allow_few_pairs:
        raise ValueError(f"--pairs {s.pairs}: a ratio needs ≥ {MIN_HEADLINE_PAIRS} measured pairs "
                         "(--allow-few-pairs for a quick check, which is then no headline)")  # fmt: skip
    if not 1 <= s.docs <= s.seq_len:
        raise ValueError(f"--docs {s.docs}: between 1 and --seq-len ({s.seq_len}) documents per row")


def document_lengths(seq_len: int, docs: int, seed: int) -> list[int]:
    """`docs` lengths ≥ 1 summing to seq_len: distinct random cut points (seeded), as packed documents fall."""
    gen = torch.Generator().manual_seed(seed)
    cuts = (torch.randperm(seq_len - 1, generator=gen)[: docs - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, seq_len]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def doc_ids_of(lengths: list[int], batch: int, device: torch.device) -> torch.Tensor:
    """(batch, T) int32: every row packed with the same documents."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids.to(device=device, dtype=torch.int32).expand(batch, -1).contiguous()


def make_step(
    s: DocmaskSettings, device: torch.device, doc_ids: torch.Tensor | None
) -> Callable[[torch.Tensor], float]:
    """A fresh model (same seed, same weights for both variants) and its optimizer: `step(ids) -> loss`."""
    model = build_model(s.preset, s.pe, s.seq_len, backend=s.backend, overrides=s.overrides, seed=s.seed)
    place_model(model, device, DTYPES[s.dtype], documents=doc_ids is not None).train()
    opt = PlainOptimizer(model)
    extra = {} if doc_ids is None else {"doc_ids": doc_ids}

    def step(ids: torch.Tensor) -> float:
        loss = model(ids[:, :-1], labels=ids[:, 1:], **extra).loss
        loss.backward()
        opt.step()
        return float(loss.detach().float())

    step.model = model  # type: ignore[attr-defined]  # for the parameter count
    return step


def backends_ran(steps: dict) -> dict[str, list[str]]:
    """{variant: the attention backends its model's execution plan runs (with the document mask for "mask")}."""
    from tapetrain.model.execution_plan import paths_ran

    return {name: paths_ran([steps[name].model.plan], documents=name == "mask")["backends"] for name in VARIANTS}


def run_docmask_benchmark(s: DocmaskSettings, progress: bool = True) -> dict:
    check_settings(s)
    device = pick_device(s.device)
    lengths = document_lengths(s.seq_len, s.docs, s.seed)
    docs = doc_ids_of(lengths, s.batch, device)
    steps = {"no_mask": make_step(s, device, None), "mask": make_step(s, device, docs)}
    batch = random_batches(steps["mask"].model.cfg.vocab_size, s.batch, s.seq_len, device, 1, s.seed)[0]
    first_loss = {name: step(batch) for name, step in steps.items()}  # the same weights: the mask's own effect
    load_before = os.getloadavg()
    warm = steady_warmup(steps, [batch], device, "mask", "no_mask", s.warmup, s.max_warmup)
    times, _ = interleaved_steps(steps, [batch], device, s.pairs, progress, first_round=warm["rounds"])
    raw = {
        "times": times,
        "warmup": warm,
        "first_loss": first_loss,
        "params": steps["mask"].model.num_params(),
        "n_layers": steps["mask"].model.cfg.n_layers,
        "load": {"before": load_before, "after": os.getloadavg()},
        "device": device_name(device),
        "backends": backends_ran(steps),
        "lengths": lengths,
    }
    return summarise(s, raw)


def summarise(s: DocmaskSettings, raw: dict[str, Any]) -> dict[str, Any]:
    """The JSON record: per variant the step-time spread and tokens/s; the per-pair ratio mask / no mask."""
    tokens = s.batch * s.seq_len
    results = []
    for name in VARIANTS:
        steps = raw["times"][name]
        results.append({"variant": name, "step_s": spread(steps), "tokens_per_s": tokens / statistics.median(steps),
                        "first_loss": raw["first_loss"][name], "step_times_s": steps})  # fmt: skip
    ratios = [m / n for n, m in zip(raw["times"]["no_mask"], raw["times"]["mask"], strict=True)]
    headline = s.pairs >= MIN_HEADLINE_PAIRS and not s.allow_few_pairs
    return {
        **report_header("docmask", raw["device"]),
        "threads": torch.get_num_threads(),
        "preset": s.preset,
        "pe": s.pe,
        "n_layers": raw["n_layers"],
        "params": raw["params"],
        "seq_len": s.seq_len,
        "batch": s.batch,
        "docs_per_row": s.docs,
        "doc_lengths": raw["lengths"],
        "dtype": s.dtype,
        "attention_backend": s.backend,
        "attention_backends_ran": raw["backends"],
        "load_average_1_5_15_min": raw["load"],
        "step": "forward + backward + AdamW step (global-norm clipping), plain PyTorch loop",
        "timing": "the two variants alternated step by step in one process, order rotated each round, after "
        "warm-up rounds; pair ratio = step time with the mask / without",
        **pairs_header(s, raw["warmup"]["rounds"], s.pairs, headline),
        "warmup_drift": raw["warmup"],
        "results": results,
        "mask_over_no_mask": {
            "pairs": len(ratios),
            "step_time_ratio": spread(ratios),
            "headline_step_time_ratio": statistics.median(ratios) if headline else None,
            "pair_ratios": ratios,
        },  # fmt: skip
    }


def docmask_report(result: dict) -> str:
    headers = ["variant", "step s median", "q1", "q3", "min", "max", "tokens/s", "first loss"]
    rows = [[r["variant"], *(r["step_s"][k] for k in ("median", "q1", "q3", "min", "max")), r["tokens_per_s"],
             r["first_loss"]] for r in result["results"]]  # fmt: skip
    ratio = result["mask_over_no_mask"]["step_time_ratio"]
    load = result["load_average_1_5_15_min"]
    lines = [
        f"docmask: {result['preset']} ({result['pe']}, {result['n_layers']} layers, {result['params'] / 1e6:.2f}M "
        f"params), {result['batch']} × {result['seq_len']} tokens, {result['docs_per_row']} documents per row, "
        f"{result['dtype']}, attention {_ran(result)}, {result['pairs']} pairs after "
        f"{result['warmup_rounds']} warm-up rounds, {result['device']}",
        format_table(headers, rows),
        f"step time mask / no mask: median {ratio['median']:.3f} (IQR {ratio['q1']:.3f}–{ratio['q3']:.3f}, "
        f"min–max {ratio['min']:.3f}–{ratio['max']:.3f}, {result['pairs']} pairs)",
        f"load average (1 min) before/after: {load['before'][0]:.2f}/{load['after'][0]:.2f} on {os.cpu_count()} cores",
    ]
    if not result["headline"]:
        lines.append(f"not a headline: fewer than {result['min_headline_pairs']} pairs allowed (--allow-few-pairs)")
    return "\n".join(lines)


def _ran(result: dict) -> str:
    return ", ".join(f"{name} {'/'.join(b)}" for name, b in result["attention_backends_ran"].items())


def plot_docmask(result: dict, path: str | Path) -> Path:
    """Left: step time per variant (median, IQR box, min–max whiskers); right: the per-pair ratios."""
    plt = pyplot()
    fig, (time_ax, ratio_ax) = plt.subplots(1, 2, figsize=(10, 4))
    rs = result["results"]
    time_ax.boxplot([r["step_times_s"] for r in rs], whis=(0, 100))  # whiskers at min and max
    time_ax.set_xticks(range(1, len(rs) + 1), [f"{r['variant']}\n{r['tokens_per_s']:,.0f} tok/s" for r in rs])
    time_ax.set_ylabel("step s")
    time_ax.set_title("training step (median, IQR, min–max)", fontsize=10)
    ratio = result["mask_over_no_mask"]
    ratio_ax.plot(range(1, ratio["pairs"] + 1), ratio["pair_ratios"], "o", color="C1")
    ratio_ax.axhline(
        ratio["step_time_ratio"]["median"], color="C1", label=f"median {ratio['step_time_ratio']['median']:.3f}"
    )
    ratio_ax.axhline(1.0, color="grey", lw=0.8)
    ratio_ax.set_xlabel("pair")
    ratio_ax.set_ylabel("step time mask / no mask")
    ratio_ax.set_title(f"{ratio['pairs']} pairs" + ("" if result["headline"] else " (no headline)"), fontsize=10)
    ratio_ax.legend(fontsize=8)
    for ax in (time_ax, ratio_ax):
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"document mask: {result['preset']} {result['pe']}, {result['batch']} × {result['seq_len']} tokens, "
                 f"{result['docs_per_row']} documents per row, attention {_ran(result)}, "
                 f"{result['device']}", fontsize=9)  # fmt: skip
    out = save_figure(fig, path)
    plt.close(fig)
    return out
