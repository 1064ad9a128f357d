"""Evaluation windows over a token stream x_0 .. x_{N-1}, one list per perplexity protocol.

A window feeds the model x[start : start + length] and scores the predictions at offsets j in
[score_from, score_to): the prediction at offset j is of x[start + j + 1] given x[start .. start + j].

  nonoverlap     start = 0, L, 2L, ... < N − L; all L predictions scored: every target x_1 .. is scored once, each
                 with between 1 and L tokens of context (the default; cheapest).
  sliding        start = 0, S, 2S, ... < N − L (stride S <= L); the first window scores all L predictions, later
                 ones only their last S (the targets no earlier window scored): every target is scored once, after
                 the first window with at least L − S tokens of context.
  longlora       LongLoRA's eval_distributed.py = the TAPE repository's eval_llama.py (the TAPE paper's PPL table):
                 start = 0, 256, 512, ... < N − L (Python's range(0, N − L, 256)); the L − 1 predictions inside each
                 window (targets x[start+1 .. start+L−1]) are all scored, so targets are scored up to L/256 times;
                 PPL = exp(total NLL / scored tokens) (torchmetrics' Perplexity). Run on R GPUs, torch's
                 DistributedSampler pads the window list to a multiple of R by repeating R-padding windows of its
                 seeded shuffle (`reference_ranks`; 1 = no padding).
  longlora-eval  LongLoRA's eval.py: the starts of longlora without the last one (eval.py pops it), batches of B
                 consecutive windows (its --batch_size, 32 by default); each batch's loss is the mean NLL over its
                 B·(L − 1) predictions, the result the plain mean of the batch losses and PPL = 2.71828 ** mean
                 (eval.py's constant, not e).

Windows only ever cover complete lengths; tail tokens that do not fill one are not scored.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from tapetrain.errors import InputError

PROTOCOLS = ("nonoverlap", "sliding", "longlora", "longlora-eval")
REFERENCE_PROTOCOLS = ("longlora", "longlora-eval")
LONGLORA_STEP = 256  # both LongLoRA scripts' sliding_window
LONGLORA_EVAL_BATCH = 32  # LongLoRA eval.py's default --batch_size
LONGLORA_E = 2.71828  # eval.py reports 2.71828 ** loss


class Window(NamedTuple):
    start: int
    score_from: int
    score_to: int

    @property
    def tokens(self) -> int:
        return self.score_to - self.score_from


def tokens_needed(length: int, protocol: str) -> int:
    """Fewest stream tokens that give `protocol` at least one window of `length` (longlora-eval: two starts, since
    eval.py drops the last)."""
    return length + 1 + (LONGLORA_STEP if protocol == "longlora-eval" else 0)


def reference_starts(n_tokens: int, length: int, drop_last: bool) -> list[int]:
    """LongLoRA's window starts: range(0, N − L, 256), without the last one when `drop_last` (eval.py)."""
    starts = list(range(0, n_tokens - length, LONGLORA_STEP))
    return starts[:-1] if drop_last else starts


def distributed_sampler_padding(n_windows: int, ranks: int) -> list[int]:
    """Indices of the windows torch's DistributedSampler (shuffle=True, seed 0, as LongLoRA's evaluators leave it)
    repeats to give `ranks` ranks equal shares; empty for one rank."""
    if ranks <= 1:
        return []
    from collections import Counter

    from torch.utils.data import DistributedSampler

    seen = Counter(i for rank in range(ranks) for i in DistributedSampler(range(n_windows), ranks, rank))
    repeated = [i for i, count in seen.items() for _ in range(count - 1)]
    return sorted(repeated)


def make_windows(
    n_tokens: int,
    length: int,
    protocol: str = "nonoverlap",
    stride: int | None = None,
    reference_ranks: int = 1,
) -> list[Window]:
    """All windows of `length` over a stream of `n_tokens` for `protocol` (see the module docstring)."""
    if length < 2 and protocol in REFERENCE_PROTOCOLS:
        raise InputError(f"length {length} is too short for the {protocol} protocol (it scores length − 1 tokens)")
    if length < 1:
        raise InputError(f"length must be >= 1, got {length}")
    if reference_ranks < 1:
        raise InputError(f"--reference-ranks must be >= 1, got {reference_ranks}")
    if reference_ranks > 1 and protocol != "longlora":
        raise InputError(f"--reference-ranks applies to --protocol longlora (DistributedSampler padding), not "
                         f"{protocol}; drop it")
    if protocol == "nonoverlap":
        return [Window(s, 0, length) for s in range(0, n_tokens - length, length)]
    if protocol == "sliding":
        if stride is None or not 1 <= stride <= length:
            raise InputError(f"--stride {stride} must be between 1 and the length {length} for the sliding protocol")
        return [Window(s, 0 if s == 0 else length - stride, length) for s in range(0, n_tokens - length, stride)]
    if protocol in REFERENCE_PROTOCOLS:
        windows = [Window(s, 0, length - 1) for s in reference_starts(n_tokens, length, protocol == "longlora-eval")]
        return windows + [windows[i] for i in distributed_sampler_padding(len(windows), reference_ranks)]
    raise InputError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")


def aggregate(protocol: str, nll: list[float], counts: list[int], batch: int = LONGLORA_EVAL_BATCH) -> dict:
    """{nll, ppl, batches} from per-window NLL sums (nats) and scored-token counts, in window order.

    Every protocol but longlora-eval weights tokens: nll = Σ NLL / Σ tokens, ppl = exp(nll). longlora-eval
    averages the mean losses of consecutive `batch`-window groups and reports 2.71828 ** that mean.
    """
    if protocol != "longlora-eval":
        mean = sum(nll) / sum(counts)
        return {"nll": mean, "ppl": math.exp(mean), "batches": None}
    if batch < 1:
        raise InputError(f"--reference-batch-size must be >= 1, got {batch}")
    means = [sum(nll[i:i + batch]) / sum(counts[i:i + batch]) for i in range(0, len(nll), batch)]
    mean = sum(means) / len(means)
    return {"nll": mean, "ppl": LONGLORA_E**mean, "batches": len(means)}
