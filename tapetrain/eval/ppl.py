"""Perplexity across context lengths: token-weighted PPL = exp(total NLL / total scored tokens).

Windows (tapetrain.eval.windows) are split over ranks when launched with torchrun/deepspeed; the NLL sums,
token and window counts are all-reduced, so every rank reports the same numbers.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from tapetrain.eval.distributed import EvalRanks, init_eval_ranks
from tapetrain.eval.models import EvalModel, load_eval_model
from tapetrain.eval.report import format_ppl_table, plot_ppl, read_json, write_json_atomic
from tapetrain.eval.tokens import EvalTokens, open_eval_tokens
from tapetrain.eval.windows import Window, make_windows, tokens_needed

log = logging.getLogger("tapetrain.eval")

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)


def score_windows(
    model: EvalModel, tokens: EvalTokens, windows: list[Window], length: int, batch_size: int, show: bool
) -> tuple[float, int]:
    """(sum of NLL in nats, scored tokens) over `windows`, batch_size windows per forward."""
    nll_sum, count = 0.0, 0
    bar = tqdm(total=sum(w.tokens for w in windows), unit="tok", unit_scale=True, disable=not show,
               desc=f"ppl@{length}", dynamic_ncols=True)
    for i in range(0, len(windows), batch_size):
        batch = windows[i:i + batch_size]
        chunks = [tokens.read(w.start, w.start + max(length, w.score_to + 1)) for w in batch]
        ids = torch.from_numpy(np.stack([c[:length] for c in chunks]))  # (B, L)
        first = min(w.score_from for w in batch)
        logits = model.logits(ids, keep_last=length - first)  # (B, L - first, V): position j at j - first
        for row, (w, chunk) in enumerate(zip(batch, chunks, strict=True)):
            targets = torch.from_numpy(chunk[w.score_from + 1:w.score_to + 1]).to(logits.device)
            scored = logits[row, w.score_from - first:w.score_to - first].float()
            nll_sum += float(F.cross_entropy(scored, targets, reduction="sum"))
            count += w.tokens
        bar.update(sum(w.tokens for w in batch))
    bar.close()
    return nll_sum, count


def evaluate_ppl(
    model: EvalModel,
    tokens: EvalTokens,
    lengths: list[int],
    protocol: str = "nonoverlap",
    stride: int | None = None,
    batch_size: int = 1,
    ranks: EvalRanks | None = None,
) -> list[dict]:
    """One result per length: {length, ppl, nll (mean per token), nll_sum, tokens, windows, seconds}."""
    ranks = ranks or EvalRanks()
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    results = []
    for length in lengths:
        need = tokens_needed(length, protocol)
        if tokens.num_tokens < need:
            raise ValueError(f"length {length} needs at least {need} tokens ({protocol} protocol) but "
                             f"{tokens.description} holds {tokens.num_tokens}; drop that length from --lengths, "
                             "raise --max-tokens or use more data")
        if model.max_seq_len and length > model.max_seq_len:
            log.warning("length %d > the model's training context %d: evaluating extrapolation", length,
                        model.max_seq_len)
        windows = make_windows(tokens.num_tokens, length, protocol, stride)
        start = time.perf_counter()
        nll_sum, count = score_windows(model, tokens, windows[ranks.rank::ranks.world_size], length, batch_size,
                                       show=ranks.is_main)
        nll_sum, count = ranks.all_reduce_sum([nll_sum, float(count)], model.device)
        nll = nll_sum / count
        results.append({"length": length, "ppl": math.exp(nll), "nll": nll, "nll_sum": nll_sum,
                        "tokens": int(count), "windows": len(windows),
                        "seconds": round(time.perf_counter() - start, 3)})
    return results


def resolve_protocol(protocol: str | None, stride: int | None) -> str:
    """--stride alone means the sliding protocol; it makes no sense with the others."""
    if protocol is None:
        return "sliding" if stride is not None else "nonoverlap"
    if protocol != "sliding" and stride is not None:
        raise ValueError(f"--stride applies to --protocol sliding, not {protocol}; drop --stride or use sliding")
    if protocol == "sliding" and stride is None:
        raise ValueError("--protocol sliding needs --stride N (tokens between window starts, e.g. 256)")
    return protocol


def run_eval_ppl(
    model_path: str,
    data: str,
    lengths: list[int] | None = None,
    *,
    protocol: str | None = None,
    stride: int | None = None,
    dtype: str = "fp32",
    max_tokens: int | None = None,
    batch_size: int = 1,
    tokenizer: str | None = None,
    token_dtype: str | None = None,
    step: int | None = None,
    out: str | None = None,
    plot: str | None = None,
    compare: list[str] | None = None,
) -> dict:
    """The `tapetrain eval-ppl` job: load, evaluate every length, write JSON/PNG and print a table (rank 0)."""
    protocol = resolve_protocol(protocol, stride)
    lengths = sorted(set(lengths or DEFAULT_LENGTHS))
    compared = [read_json(p) for p in compare or []]  # fail on a bad --compare file before the long part
    ranks = init_eval_ranks()
    try:
        model = load_eval_model(model_path, dtype, step)
        tokens = open_eval_tokens(data, tokenizer=tokenizer or model.tokenizer, token_dtype=token_dtype)
        tokens = tokens.limited(max_tokens)
        tokens.check_tokenizer(model.tokenizer_sha256, model.name)
        tokens.check_vocab(model.vocab_size)
        results = evaluate_ppl(model, tokens, lengths, protocol, stride, batch_size, ranks)
    finally:
        ranks.close()
    report = {
        "model": model.name,
        "model_kind": model.kind,
        "data": tokens.description,
        "protocol": protocol,
        "stride": stride,
        "dtype": dtype,
        "max_tokens": max_tokens,
        "data_tokens": tokens.num_tokens,
        "trained_context": model.max_seq_len,
        "world_size": ranks.world_size,
        "results": results,
    }
    if ranks.is_main:
        print(format_ppl_table(report))
        if out:
            write_json_atomic(out, report)
        if plot:
            plot_ppl([report, *compared], plot)
    return report
