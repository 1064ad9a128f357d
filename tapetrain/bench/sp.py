"""`sp` mode: sequence parallelism (DeepSpeed-Ulysses) on CPU ranks over gloo: tokens/s and activation memory per
rank at SP 1 and SP N, N = the number of ranks launched. The `cp` mode (tapetrain.bench.cp) is the same measurement
with the N ranks as a ring (context parallelism, tapetrain.parallel.ring) instead of a Ulysses group.

The mode launches its own N ranks (torch.multiprocessing, gloo on 127.0.0.1). Each rank builds every model twice
with identical weights: one sharded with the real UlyssesShard over the N-rank group (SP N: each rank holds T/N
tokens of the sequence), one unsharded (SP 1: each rank runs the whole sequence by itself, as under data
parallelism). The variants (PE × SP) are alternated step by step in the same processes, the order rotated each
round, after warm-up rounds; a barrier starts every step on all ranks together, and a variant's step time in a
round is its slowest rank's. A pair is one round's SP 1 and SP N steps of one PE; the per-pair ratio is
step time SP N / SP 1.

A step is a training forward + backward (gradients then dropped). No optimizer step and no gradient all-reduce:
with DeepSpeed both layouts reduce gradients over all N ranks and update the same parameters, the same cost, and
leaving the update out keeps the weights fixed, so every variant's loss on a batch stays comparable.

tokens/s counts each token once: an SP N group processes B sequences of T tokens per step, so its tokens/s is
B·T / step time; at SP 1 every rank is a group of its own, so the machine's tokens/s is (ranks / SP)·B·T / step.

Memory per rank (`peak_mem_kind` "saved_for_backward"): the bytes of the tensors autograd saves for backward in one
training forward (storage-deduplicated, parameters excluded), measured with saved_tensors_hooks: deterministic,
unlike RSS on a shared machine. Transients (a layer's temporaries, the exchange's buffers, the gradients) are not
in it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tapetrain.atomic_io import save_figure
from tapetrain.bench.arguments import add_model_args, add_report_args, add_rounds_args, names
from tapetrain.bench.common import DTYPES, device_name
from tapetrain.bench.header import report_header
from tapetrain.bench.pairs import MIN_HEADLINE_PAIRS, pairs_header, rotated, spread
from tapetrain.bench.report import format_table, pyplot
from tapetrain.bench.steps import build_model, random_batches
from tapetrain.model import POSITIONAL_ENCODINGS, Transformer
from tapetrain.model.execution_plan import place_model

log = logging.getLogger("tapetrain.bench")

MIB = 2**20


HELP = "sequence parallelism on CPU ranks: SP 1 vs SP N tokens/s and memory per rank"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_report_args(p, device=False)  # CPU ranks over gloo
    p.add_argument("--ranks", type=int, default=2, help="ranks to launch; SP 1 is compared with SP = ranks (default 2)")
    add_model_args(p, seq_len=1024, batch=1)
    add_rounds_args(p, "timed rounds, each one pair per PE")
    p.add_argument("--pe-list", type=names, default=["tape", "rope"], help="positional encodings (default tape,rope)")


@dataclass
class SpSettings:
    preset: str
    seq_len: int
    ranks: int = 2
    batch: int = 1
    pairs: int = MIN_HEADLINE_PAIRS
    warmup: int = 2  # untimed rounds first
    dtype: str = "fp32"
    pe_list: list[str] = field(default_factory=lambda: ["tape", "rope"])
    backend: str = "auto"
    overrides: dict[str, Any] = field(default_factory=dict)
    threads: int = 1  # torch intra-op threads per rank
    allow_few_pairs: bool = False  # tests: fewer pairs than MIN_HEADLINE_PAIRS, the JSON is then no headline
    seed: int = 0
    ring: bool = False  # the `cp` mode: the N ranks form a ring (context parallelism) instead of a Ulysses group

    @property
    def mode(self) -> str:
        return "cp" if self.ring else "sp"


def check_settings(s: SpSettings) -> None:
    """Refuse what cannot run or cannot be reported, before any rank starts."""
    unknown = [pe for pe in s.pe_list if pe not in POSITIONAL_ENCODINGS]
    if unknown:
        raise ValueError(f"--pe-list: unknown {', '.join(unknown)}; choose from {', '.join(POSITIONAL_ENCODINGS)}")
    if s.ranks < 2:
        raise ValueError("--ranks must be ≥ 2 (SP 1 and SP N are compared on N ranks)")
    if s.pairs < 1 or s.pairs < MIN_HEADLINE_PAIRS and not s.allow_few_pairs:
        raise ValueError(
            f"--pairs {s.pairs}: a ratio needs ≥ {MIN_HEADLINE_PAIRS} measured pairs "
            "(--allow-few-pairs for a short run that is marked as no headline)"
        )
    if s.seq_len % s.ranks:
        raise ValueError(f"--seq-len {s.seq_len} is not a multiple of --ranks {s.ranks}")
    if s.ring and s.seq_len % (2 * s.ranks):
        raise ValueError(f"--seq-len {s.seq_len} is not a multiple of 2 × --ranks = {2 * s.ranks} (a ring of N ranks "
                         "splits each sequence into 2N chunks)")


# ---- the launch ----------------------------------------------------------------------------------------------


def run_sp_benchmark(s: SpSettings, progress: bool = True) -> dict:
    """Launch `s.ranks` ranks, measure, and summarise rank 0's gathered record."""
    from tapetrain.distributed import reserved_port

    check_settings(s)
    load_before = os.getloadavg()  # a shared machine: how busy it was says how far to trust the spread
    with reserved_port() as port, tempfile.TemporaryDirectory(prefix="tapetrain-sp-") as tmp:
        log.info("launching %d ranks (gloo on 127.0.0.1:%d, %d thread(s) each)", s.ranks, port, s.threads)
        raw_path = Path(tmp) / "raw.json"
        torch.multiprocessing.start_processes(_rank_main, args=(s, port, str(raw_path), progress), nprocs=s.ranks,
                                              join=True, start_method="spawn")  # fmt: skip
        raw = json.loads(raw_path.read_text())
    raw["load_average_1_5_15_min"] = {"before": load_before, "after": os.getloadavg()}
    return summarise(s, raw)


def _rank_main(rank: int, s: SpSettings, port: int, raw_path: str, progress: bool) -> None:
    """One rank: join the gloo group, build DeepSpeed's SP group of all ranks, measure; rank 0 writes the record."""
    from tapetrain.distributed import DistEnv, destroy_process_group
    from tapetrain.parallel.layout import ParallelLayout
    from tapetrain.parallel.ulysses import init_sequence_parallel

    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": s.ranks, "LOCAL_WORLD_SIZE": s.ranks,
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
    os.environ.update({k: str(v) for k, v in env.items()})  # DeepSpeed's comm reads them when it adopts the group
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(levelname)s rank{rank} %(name)s: %(message)s")  # fmt: skip
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    torch.set_num_threads(s.threads)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=s.ranks)  # fmt: skip
    try:
        layout = ParallelLayout(s.ranks, 1, s.ranks) if s.ring else ParallelLayout(s.ranks, s.ranks)
        sp = init_sequence_parallel(layout, DistEnv(rank=rank, local_rank=rank, world_size=s.ranks))
        assert sp is not None
        record = measure(s, sp.shard, progress and rank == 0)
        if rank == 0:
            Path(raw_path).write_text(json.dumps(record))
    finally:
        destroy_process_group()


# ---- one rank's measurement ----------------------------------------------------------------------------------


@dataclass
class Variant:
    """One model and its per-rank batches: (inputs, labels) of shape (B, T) at SP 1 or (B, T/N) at SP N."""

    pe: str
    sp: int
    model: Transformer
    batches: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def name(self) -> str:
        return f"{self.pe} sp{self.sp}"

    def step(self, i: int) -> float:
        """Forward + backward on batch i; returns the loss (the whole sequences' mean, also when sharded)."""
        inputs, labels = self.batches[i % len(self.batches)]
        loss = self.model(inputs, labels=labels).loss
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        return float(loss.detach())


def build_variants(s: SpSettings, shard: Any) -> list[Variant]:
    """Per PE: the unsharded model and its sharded twin (same seed, same weights), on the same token batches."""
    from tapetrain.model.sequence_shard import local_tokens

    variants = []
    for sp in (1, shard.size):  # SP-major, [pe sp1 ..., pe spN ...]: rotating it balances each pair's order
        for pe in s.pe_list:
            model = build_model(s.preset, pe, s.seq_len, backend=s.backend, overrides=s.overrides, seed=s.seed)
            place_model(model, torch.device("cpu"), DTYPES[s.dtype]).train()
            ids = random_batches(model.cfg.vocab_size, s.batch, s.seq_len, torch.device("cpu"), 2, s.seed)
            batches = [(b[:, :-1], b[:, 1:]) for b in ids]  # labels shifted before slicing
            if sp > 1:
                model.shard_sequence(shard)
                mine = local_tokens(shard, s.seq_len)
                batches = [(x[:, mine].contiguous(), y[:, mine].contiguous()) for x, y in batches]
            variants.append(Variant(pe, sp, model, batches))
    return variants


def saved_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves during `forward()` (-> loss), storage-deduplicated, parameters excluded;
    then backward, so the graph is freed as in a training step."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def _saved_bytes_of(v: Variant) -> int:
    inputs, labels = v.batches[0]
    return saved_bytes(v.model, lambda: v.model(inputs, labels=labels).loss)


def timed_rounds(variants: list[Variant], rounds: int, progress: bool) -> dict[str, list[float]]:
    """Each round runs every variant once, order rotated by the round; each step starts after a barrier.
    -> {variant name: this rank's seconds per round}."""
    from tapetrain.progress import progress as progress_bar

    times: dict[str, list[float]] = {v.name: [] for v in variants}
    bar = progress_bar(range(rounds), desc="sp rounds", unit="round", disable=not progress)
    for r in bar:
        for v in rotated(variants, r):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            v.step(r)
            times[v.name].append(time.perf_counter() - t0)
        bar.set_postfix_str(" ".join(f"{name} {t[-1]:.3g}s" for name, t in times.items()))
    return times


def attention_backends_ran(variants: list[Variant]) -> list[str]:
    """The attention backends the variants' models run (their execution plans)."""
    from tapetrain.model.execution_plan import paths_ran

    return paths_ran([v.model.plan for v in variants])["backends"]


def measure(s: SpSettings, shard: Any, progress: bool) -> dict[str, Any]:
    """This rank's part: saved bytes and first losses of each variant, then warm-up + timed rounds; the slowest
    rank's time per step and every rank's saved bytes are gathered (collective)."""
    torch.manual_seed(s.seed)
    variants = build_variants(s, shard)
    log.info("built %s (%.1fM parameters each); measuring saved bytes", ", ".join(v.name for v in variants),
             variants[0].model.num_params() / 1e6)  # fmt: skip
    saved = {v.name: _saved_bytes_of(v) for v in variants}
    losses = {v.name: v.step(0) for v in variants}
    log.info("%d warm-up + %d timed rounds of %d steps", s.warmup, s.pairs, len(variants))
    times = timed_rounds(variants, s.warmup + s.pairs, progress)
    cfg = variants[0].model.cfg
    loss_backend = variants[0].model.plan.loss
    chunked = loss_backend == "chunked"
    every: list[Any] = [None] * shard.size
    torch.distributed.all_gather_object(every, {"saved": saved, "times": times})
    return {
        "variants": [{"name": v.name, "pe": v.pe, "sp": v.sp} for v in variants],
        "params": variants[0].model.num_params(),
        "n_layers": variants[0].model.cfg.n_layers,
        "saved_bytes_per_rank": {v.name: [r["saved"][v.name] for r in every] for v in variants},
        "step_times_s": {  # per round: the slowest rank's
            v.name: [max(r["times"][v.name][i] for r in every) for i in range(s.warmup, s.warmup + s.pairs)]
            for v in variants
        },
        "first_loss": losses,
        "attention_backends": attention_backends_ran(variants),
        "loss_backend": loss_backend,
        # the chunked loss computes the LM head's weight gradient (V, C) in forward and saves it: per rank, any N
        "lm_head_grad_bytes": cfg.vocab_size * cfg.d_model * DTYPES[s.dtype].itemsize if chunked else 0,
        "device": device_name(torch.device("cpu")),
    }


# ---- summary, report, figure ---------------------------------------------------------------------------------


def summarise(s: SpSettings, raw: dict[str, Any]) -> dict[str, Any]:
    """The JSON record: per variant step-time spread, tokens/s, saved bytes per rank; per PE the pair ratios."""
    tokens = s.batch * s.seq_len  # one SP group's tokens per step, each counted once
    results = []
    for v in raw["variants"]:
        steps = raw["step_times_s"][v["name"]]
        median = statistics.median(steps)
        per_rank = raw["saved_bytes_per_rank"][v["name"]]
        results.append({**v, "tokens_per_rank": s.seq_len // v["sp"] * s.batch, "step_s": spread(steps),
                        "tokens_per_s_per_group": tokens / median,
                        "tokens_per_s_machine": s.ranks // v["sp"] * tokens / median,
                        "saved_bytes_per_rank": per_rank, "saved_mib_per_rank": max(per_rank) / MIB,
                        "first_loss": raw["first_loss"][v["name"]], "step_times_s": steps})  # fmt: skip
    headline = s.pairs >= MIN_HEADLINE_PAIRS and not s.allow_few_pairs
    return {
        **_header(s, raw["device"]),
        "preset": s.preset,
        "n_layers": raw["n_layers"],
        "params": raw["params"],
        "seq_len": s.seq_len,
        "batch": s.batch,
        "dtype": s.dtype,
        "ranks": s.ranks,
        "threads_per_rank": s.threads,
        "dist_backend": "gloo",
        "load_average_1_5_15_min": raw["load_average_1_5_15_min"],
        "attention_backend": s.backend,
        "attention_backends_ran": raw["attention_backends"],
        "loss_backend": raw["loss_backend"],
        "lm_head_grad_mib": raw["lm_head_grad_bytes"] / MIB,
        "overrides": s.overrides,
        "step": "training forward + backward, gradients dropped (no optimizer step, no gradient all-reduce)",
        "timing": "variants alternated step by step in one process per rank, order rotated each round, barrier "
        "before each step; a variant's step time per round is its slowest rank's; pair ratio = SP N / SP 1",
        "peak_mem_kind": "saved_for_backward",
        "peak_mem_note": "bytes autograd saves for backward in one training forward, per rank (saved_tensors_hooks, "
        "storage-deduplicated, parameters excluded); transients (temporaries, exchange buffers, gradients) not "
        "included; with the chunked loss it holds the LM head's weight gradient (lm_head_grad_mib), computed in "
        "forward, which does not shrink with N",
        **pairs_header(s, s.warmup, s.pairs, headline),
        "results": results,
        "pairs_by_pe": [_pair_summary(pe, results, headline) for pe in s.pe_list],
    }


def _header(s: SpSettings, device: str) -> dict[str, Any]:
    if s.ring:
        from tapetrain.bench.cp import header

        return header(device)
    return report_header("sp", device)


def _pair_summary(pe: str, results: list[dict], headline: bool) -> dict[str, Any]:
    one, many = (r for r in results if r["pe"] == pe)
    ratios = [b / a for a, b in zip(one["step_times_s"], many["step_times_s"], strict=True)]
    return {
        "pe": pe,
        "sp": many["sp"],
        "pairs": len(ratios),
        "step_time_ratio": spread(ratios),  # SP N / SP 1, per pair
        "headline_step_time_ratio": statistics.median(ratios) if headline else None,
        "saved_bytes_ratio": many["saved_mib_per_rank"] / one["saved_mib_per_rank"],
        "loss_sp_n_minus_sp1": many["first_loss"] - one["first_loss"],  # the sharded model computes the same
        "pair_ratios": ratios,
    }


def sp_report(result: dict) -> str:
    headers = ["pe", "SP", "tokens/rank", "step s median", "min", "max", "tokens/s group", "tokens/s machine",
               "saved MiB/rank"]  # fmt: skip
    rows = [[r["pe"], r["sp"], r["tokens_per_rank"], r["step_s"]["median"], r["step_s"]["min"], r["step_s"]["max"],
             r["tokens_per_s_per_group"], r["tokens_per_s_machine"], r["saved_mib_per_rank"]]
            for r in result["results"]]  # fmt: skip
    lines = [
        f"{result['mode']}: {result['preset']} ({result['n_layers']} layers, {result['params'] / 1e6:.1f}M params), "
        f"{result['batch']} × {result['seq_len']} tokens, {result['dtype']}, {result['ranks']} ranks × "
        f"{result['threads_per_rank']} thread(s), gloo, attention {'/'.join(result['attention_backends_ran'])}, "
        f"{result['pairs']} pairs after {result['warmup_rounds']} warm-up rounds, {result['device']}",
        format_table(headers, rows),
    ]
    for p in result["pairs_by_pe"]:
        ratio = p["step_time_ratio"]
        lines.append(f"{p['pe']}: step time {result['mode'].upper()} {p['sp']} / 1 median {ratio['median']:.3f} "
                     f"(IQR {ratio['q1']:.3f}–"
                     f"{ratio['q3']:.3f}, min–max {ratio['min']:.3f}–{ratio['max']:.3f}, {p['pairs']} pairs); "
                     f"saved bytes per rank ×{p['saved_bytes_ratio']:.3f}")  # fmt: skip
    load = result["load_average_1_5_15_min"]
    lines.append(
        f"load average (1 min) before/after: {load['before'][0]:.2f}/{load['after'][0]:.2f} on {os.cpu_count()} cores"
    )
    if not result["headline"]:
        lines.append(f"not a headline: fewer than {result['min_headline_pairs']} pairs allowed (--allow-few-pairs)")
    return "\n".join(lines)


def plot_sp(result: dict, path: str | Path) -> Path:
    """Left: saved activation MiB per rank by SP degree; right: step time per variant, median and min–max."""
    plt = pyplot()
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 4))
    rs = result["results"]
    labels = [f"{r['pe']}\nSP {r['sp']}" for r in rs]
    colors = [f"C{result['settings']['pe_list'].index(r['pe'])}" for r in rs]
    bars = mem_ax.bar(labels, [r["saved_mib_per_rank"] for r in rs], color=colors)
    mem_ax.bar_label(bars, fmt="%.1f", fontsize=8)
    mem_ax.set_ylabel("MiB per rank (saved for backward)")
    mem_ax.set_title("activation memory per rank", fontsize=10)
    medians = [r["step_s"]["median"] for r in rs]
    errors = [[m - r["step_s"]["min"] for m, r in zip(medians, rs, strict=True)],
              [r["step_s"]["max"] - m for m, r in zip(medians, rs, strict=True)]]  # fmt: skip
    bars = time_ax.bar(labels, medians, yerr=errors, capsize=4, color=colors)
    time_ax.bar_label(bars, labels=[f"{r['tokens_per_s_per_group']:,.0f} tok/s" for r in rs], fontsize=8)
    time_ax.set_ylabel("step s (median, min–max)")
    time_ax.set_title(f"fwd+bwd step, {result['pairs']} pairs" + ("" if result["headline"] else " (no headline)"),
                      fontsize=10)  # fmt: skip
    for ax in (mem_ax, time_ax):
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"sequence parallelism: {result['preset']} ({result['n_layers']} layers), {result['batch']} × "
                 f"{result['seq_len']} tokens, {result['ranks']} CPU ranks × {result['threads_per_rank']} thread(s)",
                 fontsize=10)  # fmt: skip
    out = save_figure(fig, path)
    plt.close(fig)
    return out
