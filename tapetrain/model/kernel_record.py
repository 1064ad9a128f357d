"""Which fused GPU paths have passed their tests on which kind of GPU: the record `auto` consults.

A *path* is one way a computation runs: (kind, backend, GPU capability, dtype, features). Kinds are "attention"
(features: `e` = TAPE's state as extra values, `docs` = document mask, `gqa` = fewer key than query heads), "loss"
(the fused linear cross-entropy) and "tape_update" (TAPE's fused E updates, model/tape_fused.py). The GPU campaign
(`make gpu-check`) runs the gpu-marked tests; each test declares what it verifies with `@pytest.mark.verifies(...)`,
and `tapetrain.bench.campaign_record` turns the junit XML into a campaign record. Committed campaigns live in
`kernel_record.json` next to this file (`tools/kernel_record.py merge` adds one).

`auto` picks a fused path (Triton, flash-attn, FlexAttention, liger) only where the newest campaign on that GPU
capability that tested it saw it pass; otherwise it falls back to PyTorch's own kernels (SDPA, the chunked loss).
A path named explicitly still runs, with one warning saying it is unverified and how to verify it.

A campaign may also carry `timings` (the attention bake-off, `tools/benchmark.py bakeoff`: fwd+bwd ms and TFLOP/s
per backend, head dim, sequence length and features, and whether its output and gradients matched the fp32
reference); `fastest_attention` reads them: `attn_backend: auto` takes the fastest verified exact path.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger("tapetrain.model")

RECORD_FILE = Path(__file__).with_name("kernel_record.json")
RECORD_ENV = "TAPETRAIN_KERNEL_RECORD"  # another record (a test's, or a cluster's own campaign)
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Always available to auto as the fallback: PyTorch's own kernels. They are recorded too when a campaign tests them.
FALLBACKS = {"attention": ("sdpa", "eager"), "loss": ("chunked", "plain"), "tape_update": ("eager",)}
HOW_TO_VERIFY = "run `make gpu-check` on this kind of GPU and commit its kernel-record.json (docs/performance.md)"


@dataclass(frozen=True)
class KernelKey:
    kind: str  # "attention" | "loss" | "tape_update"
    backend: str
    capability: str  # "9.0" (H100, H200), "8.0" (A100), ...
    dtype: str  # "bf16" | "fp16" | "fp32"
    e: bool = False
    docs: bool = False
    gqa: bool = False

    def describe(self) -> str:
        feats = [name for name, on in (("E", self.e), ("document mask", self.docs), ("GQA", self.gqa)) if on]
        return f"{self.kind} backend {self.backend!r} on sm_{self.capability.replace('.', '')} {self.dtype}" + (
            f" with {', '.join(feats)}" if feats else ""
        )


def capability_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@lru_cache(maxsize=4)
def _load(path: str) -> tuple[dict, ...]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return ()
    except json.JSONDecodeError as err:
        raise ValueError(f"kernel record {path} is not valid JSON ({err}); restore it from git") from err
    return tuple(data.get("campaigns", ()))


def campaigns() -> tuple[dict, ...]:
    """The committed campaigns, or those of $TAPETRAIN_KERNEL_RECORD."""
    return _load(os.environ.get(RECORD_ENV) or str(RECORD_FILE))


def status(path: KernelKey) -> tuple[bool | None, dict | None]:
    """(passed, campaign) from the newest campaign on this capability that tested `path`; (None, None) when none did."""
    key = asdict(path)
    for campaign in sorted(campaigns(), key=lambda c: c.get("date", ""), reverse=True):
        if campaign.get("capability") != path.capability:
            continue
        for entry in campaign.get("paths", ()):
            if all(entry.get(k) == v for k, v in key.items() if k != "capability"):
                return bool(entry.get("passed")), campaign
    return None, None


def is_verified(path: KernelKey) -> bool:
    return status(path)[0] is True


_warned: set[KernelKey] = set()


def warn_if_unverified(path: KernelKey) -> None:
    """One warning line per process and path when a path named explicitly has not passed on this kind of GPU."""
    if path in _warned or path.backend in FALLBACKS[path.kind] or torch.compiler.is_compiling():
        return
    _warned.add(path)
    passed, campaign = status(path)
    if passed:
        return
    seen = "failed its tests in the campaign of " + f"{campaign['date']} ({campaign['device']})" if campaign else \
        "has not been tested on this kind of GPU"  # fmt: skip
    log.warning("%s is unverified: it %s; it runs because it was asked for by name. To verify it, %s",
                path.describe(), seen, HOW_TO_VERIFY)


def _timing_matches(entry: dict, dtype: str, head_dim: int, e: bool, docs: bool, gqa: bool) -> bool:
    return (entry.get("kind", "attention") == "attention" and entry.get("dtype") == dtype
            and entry.get("head_dim") == head_dim and bool(entry.get("e")) == e
            and bool(entry.get("docs")) == docs and bool(entry.get("gqa")) == gqa)


def fastest_attention(capability: str, dtype: str, head_dim: int, e: bool, docs: bool, gqa: bool,
                      candidates: Iterable[str]) -> str | None:
    """The fastest of `candidates` for attention of head dim `head_dim` with those features on this GPU capability,
    by the newest campaign on it that timed any attention of that kind (its `timings`, from the bake-off,
    tools/benchmark.py bakeoff). A candidate counts only when that bake-off found it exact and timed it, and, for
    a fused path (not PyTorch's own, FALLBACKS), the record verifies it (its gpu-marked tests passed:
    `is_verified`). Candidates are compared on the sequence lengths timed for all of them (sum of fwd+bwd ms);
    with none in common, on the longest length any was timed at.
    None when no candidate qualifies: the caller falls back to PyTorch's own kernels."""
    wanted = list(dict.fromkeys(candidates))
    here = sorted((c for c in campaigns() if c.get("capability") == capability), key=lambda c: c.get("date", ""),
                  reverse=True)
    for campaign in here:
        timed = [t for t in campaign.get("timings", ()) if _timing_matches(t, dtype, head_dim, e, docs, gqa)]
        if timed:
            break
    else:
        return None
    ms: dict[str, dict[int, float]] = {}
    for entry in timed:
        name = entry.get("backend")
        if name in wanted and entry.get("exact") is True and entry.get("fwd_bwd_ms") is not None:
            ms.setdefault(name, {})[int(entry["seq_len"])] = float(entry["fwd_bwd_ms"])
    ms = {name: by_len for name, by_len in ms.items() if name in FALLBACKS["attention"]
          or is_verified(KernelKey("attention", name, capability, dtype, e=e, docs=docs, gqa=gqa))}
    if not ms:
        return None
    common = set.intersection(*(set(by_len) for by_len in ms.values()))
    if not common:
        longest = max(t for by_len in ms.values() for t in by_len)
        common = {longest}
        ms = {name: by_len for name, by_len in ms.items() if longest in by_len}
    return min(ms, key=lambda name: (sum(ms[name][t] for t in common), wanted.index(name)))


def clear_cache() -> None:
    """Forget the loaded record (after a merge, or a test that points $TAPETRAIN_KERNEL_RECORD elsewhere)."""
    _load.cache_clear()
    _warned.clear()
