"""Perplexity across context lengths: token-weighted PPL = exp(total NLL / total scored tokens).

Windows (tapetrain.eval.windows) are split over ranks when launched with torchrun/deepspeed; the NLL sums,
token and window counts are all-reduced, so every rank reports the same numbers. With --sequence-parallel U and/or
--context-parallel R the windows are split over the W/N groups (N = R × U) and each rank of a group scores the
predictions of its tokens of a window, a slice or a ring rank's two chunks (tapetrain.eval.sequence_parallel); the
same all-reduce adds the group's partial sums.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from tapetrain.atomic_io import write_json
from tapetrain.distributed import EvalRanks, all_reduce_sum, init_eval_ranks
from tapetrain.errors import InputError
from tapetrain.eval.models import EvalModel, load_eval_model, seed_eval
from tapetrain.eval.report import format_ppl_table, plot_ppl, read_json
from tapetrain.eval.sequence_parallel import check_sequence_parallel, start_sequence_parallel
from tapetrain.eval.tokens import EvalTokens, open_eval_tokens
from tapetrain.eval.windows import LONGLORA_EVAL_BATCH, Window, aggregate, make_windows, tokens_needed
from tapetrain.progress import progress as progress_bar

log = logging.getLogger("tapetrain.eval")

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)


def position_runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """positions (k,) ascending within runs -> (column, first position, count) of each run of consecutive positions:
    one for a contiguous slice, up to two for a ring rank's two chunks (so logits are sliced, never gathered)."""
    if not positions.numel():
        return []
    breaks = (torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist()
    bounds = [0, *breaks, positions.numel()]
    starts = positions[bounds[:-1]].tolist()
    return [(a, first, b - a) for a, b, first in zip(bounds[:-1], bounds[1:], starts, strict=True)]


def score_windows(
    model: EvalModel, tokens: EvalTokens, windows: list[Window], length: int, batch_size: int, show: bool
) -> list[float]:
    """NLL sum (nats) of each window's scored predictions, batch_size windows per forward; under sequence
    parallelism of the predictions this rank holds (a ring rank's two chunks; the group's sums add up to the
    window's)."""
    nll: list[float] = []
    bar = progress_bar(total=sum(w.tokens for w in windows), unit="tok", unit_scale=True, disable=not show,
                       desc=f"ppl@{length}")
    for i in range(0, len(windows), batch_size):
        batch = windows[i:i + batch_size]
        chunks = [tokens.read(w.start, w.start + max(length, w.score_to + 1)) for w in batch]
        ids = torch.from_numpy(np.stack([c[:length] for c in chunks]))  # (B, L)
        keep = length - min(w.score_from for w in batch)
        logits, held = model.logits_span(ids, keep_last=keep)  # (B, k, V) at positions held (k,)
        runs = position_runs(held)
        for row, (w, chunk) in enumerate(zip(batch, chunks, strict=True)):
            total = 0.0
            for column, first, count in runs:
                lo, hi = max(w.score_from, first), min(w.score_to, first + count)  # the scored positions held here
                if lo >= hi:
                    continue
                targets = torch.from_numpy(chunk[lo + 1:hi + 1]).to(logits.device)
                scored = logits[row, column + lo - first:column + hi - first].float()  # a view, in fp32
                total += float(F.cross_entropy(scored, targets, reduction="sum"))
            nll.append(total)
        bar.update(sum(w.tokens for w in batch))
    bar.close()
    return nll


def evaluate_ppl(
    model: EvalModel,
    tokens: EvalTokens,
    lengths: list[int],
    protocol: str = "nonoverlap",
    stride: int | None = None,
    batch_size: int = 1,
    ranks: EvalRanks | None = None,
    reference_ranks: int = 1,
    reference_batch_size: int = LONGLORA_EVAL_BATCH,
) -> list[dict]:
    """One result per length: {length, ppl, nll, nll_sum, tokens, windows, batches, seconds, window_nll,
    window_tokens} (the last two per window, in window order: what confidence intervals resample).

    nll is the protocol's mean loss (per token, or per batch for longlora-eval) and ppl its perplexity; windows
    count repeats (longlora with reference_ranks > 1). `batch_size` only sets windows per forward pass.
    """
    ranks = ranks or EvalRanks()
    if batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {batch_size}")
    for length in lengths:  # every length before the first forward: no half-done job on a data shortage
        need = tokens_needed(length, protocol)
        if tokens.num_tokens < need:
            raise InputError(f"length {length} needs at least {need} tokens ({protocol} protocol) but "
                             f"{tokens.description} holds {tokens.num_tokens}; drop that length from --lengths, "
                             "raise --max-tokens or use more data")
    results = []
    for length in lengths:
        if model.max_seq_len and length > model.max_seq_len:
            log.warning("length %d > the model's training context %d: evaluating extrapolation", length,
                        model.max_seq_len)
        windows = make_windows(tokens.num_tokens, length, protocol, stride, reference_ranks)
        start = time.perf_counter()
        mine = ranks.share(len(windows))
        scored = score_windows(model, tokens, [windows[i] for i in mine], length, batch_size, show=ranks.is_main)
        per_window = [0.0] * len(windows)  # every rank fills its own windows; the sum over ranks fills them all
        for i, value in zip(mine, scored, strict=True):
            per_window[i] = value
        per_window = all_reduce_sum(per_window, model.device)  # with sequence parallelism: + the group's parts
        counts = [w.tokens for w in windows]
        summary = aggregate(protocol, per_window, counts, reference_batch_size)
        results.append({"length": length, "ppl": summary["ppl"], "nll": summary["nll"],
                        "nll_sum": sum(per_window), "tokens": sum(counts), "windows": len(windows),
                        "batches": summary["batches"], "seconds": round(time.perf_counter() - start, 3),
                        "window_nll": per_window, "window_tokens": counts})
    return results


def resolve_protocol(
    protocol: str | None, stride: int | None, reference_ranks: int = 1, reference_batch_size: int | None = None
) -> str:
    """--stride alone means the sliding protocol; it and the reference knobs make no sense with other protocols."""
    if protocol is None:
        protocol = "sliding" if stride is not None else "nonoverlap"
    if reference_ranks != 1 and protocol != "longlora":
        raise InputError(f"--reference-ranks applies to --protocol longlora, not {protocol}; drop it")
    if reference_batch_size is not None and protocol != "longlora-eval":
        raise InputError(f"--reference-batch-size applies to --protocol longlora-eval, not {protocol}; drop it")
    if protocol != "sliding" and stride is not None:
        raise InputError(f"--stride applies to --protocol sliding, not {protocol}; drop --stride or use sliding")
    if protocol == "sliding" and stride is None:
        raise InputError("--protocol sliding needs --stride N (tokens between window starts, e.g. 256)")
    return protocol


def open_model_tokens(model: EvalModel, data: str, *, tokenizer: str | None = None, token_dtype: str | None = None,
                      split: str | None = None, max_tokens: int | None = None) -> EvalTokens:
    """The eval data for `model`: opened (text tokenized with the model's tokenizer), limited to max_tokens, and
    checked against the model's tokenizer and vocabulary."""
    tokens = open_eval_tokens(data, tokenizer=tokenizer or model.tokenizer, token_dtype=token_dtype, split=split)
    tokens = tokens.limited(max_tokens)
    tokens.check_tokenizer(model.tokenizer_sha256, model.name)
    tokens.check_vocab(model.vocab_size)
    return tokens


def ppl_report(
    model: EvalModel, tokens: EvalTokens, lengths: list[int], protocol: str = "nonoverlap", *,
    stride: int | None = None, batch_size: int = 1, ranks: EvalRanks | None = None, reference_ranks: int = 1,
    reference_batch_size: int | None = None, max_tokens: int | None = None,
) -> dict:
    """The result dict `eval ppl --out` writes (every rank returns it)."""
    ranks = ranks or EvalRanks()
    reference_batch_size = reference_batch_size or LONGLORA_EVAL_BATCH
    results = evaluate_ppl(model, tokens, lengths, protocol, stride, batch_size, ranks, reference_ranks,
                           reference_batch_size)
    return {
        "model": model.name,
        "model_kind": model.kind,
        "data": tokens.description,
        "protocol": protocol,
        "stride": stride,
        "reference_ranks": reference_ranks if protocol == "longlora" else None,
        "reference_batch_size": reference_batch_size if protocol == "longlora-eval" else None,
        "dtype": model.dtype,
        "max_tokens": max_tokens,
        "data_tokens": tokens.num_tokens,
        "trained_context": model.max_seq_len,
        "world_size": ranks.world_size,
        "sequence_parallel": ranks.sequence_parallel,
        "context_parallel": ranks.context_parallel,
        "results": results,
    }


def run_eval_ppl(
    model_path: str,
    data: str,
    lengths: list[int] | None = None,
    *,
    protocol: Literal["nonoverlap", "sliding", "longlora", "longlora-eval"] | None = None,
    stride: int | None = None,
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
    max_tokens: int | None = None,
    batch_size: int = 1,
    tokenizer: str | None = None,
    token_dtype: Literal["uint16", "uint32"] | None = None,
    step: int | None = None,
    out: str | None = None,
    plot: str | None = None,
    compare: list[str] | None = None,
    split: Literal["val", "train"] | None = None,
    reference_ranks: int = 1,
    reference_batch_size: int | None = None,
    sequence_parallel: int = 1,
    context_parallel: int = 1,
) -> dict:
    """Perplexity across context lengths (token-weighted; several ranks under torchrun/deepspeed).

    The `tapetrain eval ppl` job: load, evaluate every length, write JSON/PNG and print a table (rank 0).

    Args:
        model_path: Hugging Face export directory or run directory
        data: flat uint16 .bin (LongLoRA), prepared shard directory, or text
        lengths: context lengths (default 1024,2048,4096,8192)
        protocol: nonoverlap (default: each target once); sliding (needs --stride); longlora = the TAPE paper's
            PPL table: LongLoRA's eval_distributed.py and the TAPE repository's eval_llama.py (starts range(0,
            N-L, 256), all L-1 predictions of each window scored, token-weighted); longlora-eval = LongLoRA's
            eval.py (the same starts minus the last, mean of per-batch mean losses, 2.71828**loss)
        stride: sliding protocol: tokens between window starts
        dtype: compute dtype (the references ran fp16)
        max_tokens: evaluate the first N tokens of the data only
        batch_size: windows per forward pass
        tokenizer: for text data: a sentencepiece .model, a tokenizer.json or a model directory (default: the
            model's)
        token_dtype: .bin id width (default uint16)
        step: run directories: checkpoint step (default newest)
        out: result JSON
        plot: PNG of PPL vs length (with any --compare results)
        compare: earlier result JSON files to plot too
        split: shard directories: split to evaluate (default val; without a val split, --split train must be
            given)
        reference_ranks: longlora: the GPUs the reference ran on; DistributedSampler then repeats windows to a
            multiple of R (1: no repeats)
        reference_batch_size: longlora-eval: windows per averaged batch, eval.py's --batch_size (default 32)
        sequence_parallel: ranks that share each window (DeepSpeed-Ulysses), each holding length / N of its
            tokens, for lengths one GPU cannot hold; needs a run directory, a launch of a multiple of N ranks
            (torchrun/deepspeed) and lengths that are multiples of N; the numbers equal one process's
        context_parallel: a ring of R groups that share each window (ring attention, past one node), each rank
            holding two opposite chunks of length / (2R) tokens (split over --sequence-parallel U inside each
            group: R × U ranks a window); lengths must be multiples of 2·R·U; the numbers equal one process's
    """
    protocol = resolve_protocol(protocol, stride, reference_ranks, reference_batch_size)
    lengths = sorted(set(lengths or DEFAULT_LENGTHS))
    compared = [read_json(p) for p in compare or []]  # fail on a bad --compare file before the long part
    check_sequence_parallel(sequence_parallel, model_path, step, lengths, context_parallel=context_parallel)
    ranks = init_eval_ranks()
    try:
        ranks, shard = start_sequence_parallel(ranks, sequence_parallel, context_parallel)
        # Uncompiled under sequence parallelism: training refuses the all-to-all (and the ring) in compiled layers.
        model = load_eval_model(model_path, dtype, step, compile=False if shard else None)
        model.shard_sequence(shard)
        seed_eval()
        tokens = open_model_tokens(model, data, tokenizer=tokenizer, token_dtype=token_dtype, split=split,
                                   max_tokens=max_tokens)
        report = ppl_report(model, tokens, lengths, protocol, stride=stride, batch_size=batch_size, ranks=ranks,
                            reference_ranks=reference_ranks, reference_batch_size=reference_batch_size,
                            max_tokens=max_tokens)
    finally:
        ranks.close()
    if ranks.is_main:
        print(format_ppl_table(report))
        if out:
            write_json(out, report, parents=True)
        if plot:
            plot_ppl([report, *compared], plot)
    return report
