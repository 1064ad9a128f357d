"""Evaluation windows over a token stream x_0 .. x_{N-1}, one list per perplexity protocol.

A window feeds the model x[start : start + length] and scores the predictions at offsets j in
[score_from, score_to): the prediction at offset j is of x[start + j + 1] given x[start .. start + j].

  nonoverlap  start = 0, L, 2L, ...; all L predictions scored: every target x_1 .. is scored once, each with
              between 1 and L tokens of context (the default; cheapest).
  sliding     start = 0, S, 2S, ... (stride S <= L); the first window scores all L predictions, later ones only
              their last S (the targets no earlier window scored): every target is scored once, after the first
              window with at least L − S tokens of context.
  longlora    start = 0, 256, 512, ...; the L − 1 predictions inside each window (targets x[start+1 .. start+L−1])
              are all scored, so targets are scored up to L/256 times (LongLoRA's and the TAPE paper's eval).

Windows only ever cover complete lengths; tail tokens that do not fill one are not scored.
"""

from __future__ import annotations

from typing import NamedTuple

PROTOCOLS = ("nonoverlap", "sliding", "longlora")
LONGLORA_STEP = 256


class Window(NamedTuple):
    start: int
    score_from: int
    score_to: int

    @property
    def tokens(self) -> int:
        return self.score_to - self.score_from


def tokens_needed(length: int, protocol: str) -> int:
    """Stream tokens the first window of `length` needs (inputs plus the targets it scores)."""
    return length if protocol == "longlora" else length + 1


def make_windows(n_tokens: int, length: int, protocol: str = "nonoverlap", stride: int | None = None) -> list[Window]:
    """All windows of `length` over a stream of `n_tokens` for `protocol` (see the module docstring)."""
    if length < 2 and protocol == "longlora":
        raise ValueError(f"length {length} is too short for the longlora protocol (it scores length − 1 tokens)")
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if protocol == "nonoverlap":
        return [Window(s, 0, length) for s in range(0, n_tokens - length, length)]
    if protocol == "sliding":
        if stride is None or not 1 <= stride <= length:
            raise ValueError(f"--stride {stride} must be between 1 and the length {length} for the sliding protocol")
        return [Window(s, 0 if s == 0 else length - stride, length) for s in range(0, n_tokens - length, stride)]
    if protocol == "longlora":
        return [Window(s, 0, length - 1) for s in range(0, n_tokens - length + 1, LONGLORA_STEP)]
    raise ValueError(f"unknown protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
