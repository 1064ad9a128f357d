"""`bakeoff` mode: every exact way to attend with TAPE's [V ‖ E] (and RoPE's plain values) raced per head dim D,
sequence length T and document masking, on the GPU campaign's machine; its JSON feeds the kernel record's timings
(tools/kernel_record.py from-junit --bakeoff), the table `attn_backend: auto` ranks by.

Per group (D, T, plain or packed documents), in order of priority (D = 128, T = 8192 first):
  1. the fp32 eager reference (row by row: the (T, T) matrix of one row at a time), and the same in the run's dtype
     (the error a plain implementation at that precision makes);
  2. each candidate's first forward+backward, timed apart (flash-attn-4 compiles each new shape then, or loads it
     from its disk cache, FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1), then its exactness: the output, A·E and every
     gradient against the fp32 reference, each within max(2 × the same-precision eager error, 1e-2) (relative to
     the reference's largest value, which must be non-zero); a candidate that fails to run or misses is not timed;
  3. the exact candidates' forward+backward alternated call by call for `rounds` rounds (tapetrain.bench.pairs).
A group starts only while the budget lasts; the groups left are listed with the command that runs them (a
follow-up call on the warm machine, whose flash-attn-4 disk cache then holds the compiled kernels).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tapetrain.bench.arguments import add_report_args, ints, names
from tapetrain.bench.common import DTYPES, device_name, pick_device, release_memory, synchronize
from tapetrain.bench.header import report_header
from tapetrain.bench.pairs import MIN_HEADLINE_PAIRS, interleaved_times, spread
from tapetrain.bench.report import format_table
from tapetrain.model.attention import _IMPLS, FA4_BACKENDS, backend_available, eager_attention
from tapetrain.model.documents import DocumentMask

log = logging.getLogger("tapetrain.bench")

HELP = "attention bake-off: every exact [V ‖ E] path, exactness then alternated fwd+bwd time (the kernel record's)"
# Exact candidates per stream. Without E every flash-attn-4 backend is the same (D, D) call: "fa4" stands for them.
TAPE_CANDIDATES = ("sdpa", "triton", "flash", "flex", *FA4_BACKENDS)
ROPE_CANDIDATES = ("sdpa", "triton", "flash", "flex", "fa4")
DOCS_ONLY = ("flex",)  # FlexAttention is here for document masks only (plain causal attention is SDPA's)
TOLERANCE_FLOOR = 1e-2
D_MODEL = 2048  # heads = d_model // D: the same model width at every head dim
TOKENS = 16384  # batch = tokens // T


@dataclass(frozen=True)
class Group:
    head_dim: int
    seq_len: int
    docs: bool

    @property
    def name(self) -> str:
        return f"{self.head_dim}:{self.seq_len}:{'docs' if self.docs else 'plain'}"

    @classmethod
    def parse(cls, text: str) -> Group:
        try:
            d, t, kind = text.split(":")
            if kind not in ("plain", "docs"):
                raise ValueError(kind)
            return cls(int(d), int(t), kind == "docs")
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"a group is D:T:plain or D:T:docs (e.g. 128:8192:docs), not {text!r}") from None


def default_groups(head_dims: list[int], seq_lens: list[int]) -> list[Group]:
    """Every (D, T, plain|docs), the largest D and T first: what the budget reaches first is what matters most."""
    return [Group(d, t, docs) for d in sorted(head_dims, reverse=True) for t in sorted(seq_lens, reverse=True)
            for docs in (False, True)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_report_args(p, plot=False)
    p.add_argument("--head-dims", type=ints, default=[64, 128], help="head dims D (default 64,128)")
    p.add_argument("--seq-lens", type=ints, default=[2048, 8192], help="sequence lengths (default 2048,8192)")
    p.add_argument("--groups", type=lambda s: [Group.parse(x) for x in names(s)],
                   help="only these D:T:plain|docs groups (a follow-up call: the 'left' of a first one)")
    p.add_argument("--kv-heads-ratio", type=int, default=1, help="query heads per value head (GQA; default 1)")
    p.add_argument("--candidates", type=names, help=f"only these of {', '.join(TAPE_CANDIDATES)}")
    p.add_argument("--rounds", type=int, default=MIN_HEADLINE_PAIRS, help="timed rounds (≥ 10 for a headline)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds after the first call")
    p.add_argument("--budget-s", type=float, default=180.0, help="no group starts after this many seconds")
    p.add_argument("--tokens", type=int, default=TOKENS, help=f"batch × T (default {TOKENS})")
    p.add_argument("--d-model", type=int, default=D_MODEL, help=f"heads × D (default {D_MODEL})")


@dataclass
class BakeoffSettings:
    groups: list[Group]
    dtype: str = "bf16"
    kv_heads_ratio: int = 1
    candidates: list[str] | None = None
    rounds: int = MIN_HEADLINE_PAIRS
    warmup: int = 3
    budget_s: float = 180.0
    tokens: int = TOKENS
    d_model: int = D_MODEL
    device: str = "auto"
    seed: int = 0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)


def check_settings(s: BakeoffSettings) -> None:
    if s.dtype not in ("bf16", "fp16"):
        raise ValueError(f"--dtype {s.dtype}: the fused kernels race in 16 bits (bf16 or fp16)")
    unknown = sorted(set(s.candidates or ()) - set(TAPE_CANDIDATES))
    if unknown:
        raise ValueError(f"--candidates: unknown {', '.join(unknown)}; choose from {', '.join(TAPE_CANDIDATES)}")
    for g in s.groups:
        heads = s.d_model // g.head_dim
        if not heads or s.d_model % g.head_dim or heads % s.kv_heads_ratio or s.tokens % g.seq_len:
            raise ValueError(f"group {g.name}: --d-model {s.d_model} / D, the heads / --kv-heads-ratio "
                             f"{s.kv_heads_ratio} or --tokens {s.tokens} / T does not divide")
    if s.rounds < 1:
        raise ValueError("--rounds must be at least 1")


def document_ids(batch: int, seq_len: int) -> torch.Tensor:
    """(B, T) ids of packed documents of uneven lengths (1/2, 1/4, 1/8, the rest of each row; row b shifted by b
    tokens), so that no document boundary falls on a kernel's tile edge by luck."""
    ids = torch.empty(batch, seq_len, dtype=torch.int32)
    for b in range(batch):
        cuts = [seq_len // 2 + b, seq_len * 3 // 4 + b, seq_len * 7 // 8 + b, seq_len]
        start = 0
        for n, cut in enumerate(cuts):
            ids[b, start:cut] = 4 * b + n
            start = cut
    return ids


def attended_pairs(batch: int, heads: int, seq_len: int, docs: DocumentMask | None) -> float:
    """(query, key) pairs causal attention computes: T(T+1)/2 per row and head, per document with documents."""
    if docs is None:
        return batch * heads * seq_len * (seq_len + 1) / 2
    lengths = torch.unique_consecutive(docs.q_ids.flatten(), return_counts=True)[1].double()
    return heads * float((lengths * (lengths + 1) / 2).sum())


def _errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    out = []
    for a, b in zip(got, ref, strict=True):
        scale = b.abs().max().item()
        if scale == 0:
            raise AssertionError("the fp32 reference is zero: the comparison would prove nothing")
        out.append((a.float() - b).abs().max().item() / scale)
    return out


def _fwd_bwd(fn, inputs: tuple, cot: tuple, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """[A·V, (A·E), dq, dk, dv, (de)] of one forward+backward of `fn` on inputs (q, k, v, e or None), cast to
    `dtype` first (the references)."""
    leaves = [x for x in inputs if x is not None]
    if dtype is not None:
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in leaves]
    outs = [o for o in fn(*leaves, *([None] if len(leaves) == 3 else [])) if o is not None]
    grads = torch.autograd.grad(outs, leaves, list(cot[: len(outs)]))
    return [o.detach() for o in outs] + list(grads)


class _Problem:
    """One group's inputs (token-major storage seen heads-first, as in the model), cotangents, and references."""

    def __init__(self, g: Group, s: BakeoffSettings, device: torch.device):
        dtype = DTYPES[s.dtype]
        self.heads = s.d_model // g.head_dim
        self.batch = s.tokens // g.seq_len
        kv = self.heads // s.kv_heads_ratio
        gen = torch.Generator(device=device).manual_seed(s.seed)

        def rand(heads: int) -> torch.Tensor:
            x = torch.randn(self.batch, g.seq_len, heads, g.head_dim, generator=gen, device=device)
            return x.to(dtype).transpose(1, 2).requires_grad_(True)

        # TAPE's keys carry one head per query head (E is per query head); its values stay per kv head
        self.tape = (rand(self.heads), rand(self.heads), rand(kv), rand(self.heads))
        self.rope = (self.tape[0], rand(kv), self.tape[2], None)
        self.cot = (torch.randn_like(self.tape[0]), torch.randn_like(self.tape[0]))
        self.docs = DocumentMask.of(document_ids(self.batch, g.seq_len).to(device)) if g.docs else None
        self.refs: dict[bool, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def run(self, fn, e: bool) -> list[torch.Tensor]:
        return _fwd_bwd(fn, self.tape if e else self.rope, self.cot)

    def references(self, e: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(fp32 eager, same-precision eager), computed row by row (a (T, T) matrix per row) and kept."""
        if e not in self.refs:
            per_row: dict[torch.dtype, list[list[torch.Tensor]]] = {torch.float32: [], self.tape[0].dtype: []}
            for b in range(self.batch):
                rows = slice(b, b + 1)
                docs = None if self.docs is None else DocumentMask(self.docs.q_ids[rows], self.docs.k_ids[rows])
                inputs = tuple(None if x is None else x[rows] for x in (self.tape if e else self.rope))
                for dtype, parts in per_row.items():
                    parts.append(_fwd_bwd(lambda *x, docs=docs: eager_attention(*x, causal=True, docs=docs),
                                          inputs, tuple(c[rows] for c in self.cot), dtype))
            self.refs[e] = tuple([torch.cat(parts) for parts in zip(*rows, strict=True)]
                                 for rows in per_row.values())  # type: ignore[assignment]
        return self.refs[e]


def _candidates(s: BakeoffSettings, device: torch.device, e: bool, docs: bool) -> tuple[list[str], list[str]]:
    """(backends to race, notes on the ones left out)."""
    notes = []
    names_ = [c for c in (TAPE_CANDIDATES if e else ROPE_CANDIDATES) if not s.candidates or c in s.candidates]
    if not docs:
        names_ = [c for c in names_ if c not in DOCS_ONLY]
    out = []
    for name in names_:
        if backend_available(name, device):
            out.append(name)
        else:
            notes.append(f"{name}: not installed here")
    return out, notes


def _run_group(g: Group, s: BakeoffSettings, device: torch.device) -> tuple[list[dict], list[str]]:
    p = _Problem(g, s, device)
    rows, notes = [], []
    for e in (True, False):
        candidates, left_out = _candidates(s, device, e, g.docs)
        notes += [f"{g.name} {'tape' if e else 'rope'}: {n}" for n in left_out]
        ref32, ref_low = p.references(e)
        floor = [max(2 * err, TOLERANCE_FLOOR) for err in _errors(ref_low, ref32)]
        calls: dict[str, Callable[[], object]] = {}
        by_name: dict[str, dict] = {}
        for name in candidates:
            row = {"backend": name, "pe": "tape" if e else "rope", "e": e, "docs": g.docs,
                   "gqa": s.kv_heads_ratio > 1, "head_dim": g.head_dim, "seq_len": g.seq_len, "batch": p.batch,
                   "heads": p.heads}
            by_name[name] = row
            rows.append(row)

            def fn(*x, name=name):
                return _IMPLS[name](*x, causal=True, docs=p.docs)

            try:
                synchronize(device)
                start = time.perf_counter()
                got = p.run(fn, e)
                synchronize(device)
                row["first_call_s"] = time.perf_counter() - start  # compile (or cache load) + one run
                errors = _errors(got, ref32)
            except Exception as err:  # noqa: BLE001 - one candidate failing must not lose the others
                text = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
                row["error"] = f"{type(err).__name__}: {text}"
                log.warning("bakeoff %s %s/%s failed: %s", g.name, row["pe"], name, row["error"])
                release_memory(device)
                continue
            row["max_rel_err"] = errors
            row["tolerance"] = floor
            row["exact"] = all(err <= tol for err, tol in zip(errors, floor, strict=True))
            if row["exact"]:
                calls[name] = lambda fn=fn, e=e: p.run(fn, e)
        times = interleaved_times(calls, device, s.warmup, s.rounds) if calls else {}
        pairs = attended_pairs(p.batch, p.heads, g.seq_len, p.docs)
        dv = g.head_dim * (2 if e else 1)
        flops = 2 * pairs * (g.head_dim + dv) + 2 * pairs * (3 * g.head_dim + 2 * dv)  # fwd + bwd, as attention's
        for name, per_round in times.items():
            ms = statistics.median(per_round) * 1e3
            by_name[name].update(fwd_bwd_ms=ms, fwd_bwd_tflops=flops / (ms / 1e3) / 1e12,
                                 fwd_bwd_ms_spread={k: v * 1e3 for k, v in spread(per_round).items()})
        del calls
        release_memory(device)
    return rows, notes


def run_bakeoff(s: BakeoffSettings, progress: bool = True) -> dict:
    device = pick_device(s.device)
    start = s.clock()
    rows, notes, done, left = [], [], [], []
    for g in s.groups:
        if s.clock() - start > s.budget_s:
            left.append(g.name)
            continue
        log.info("bakeoff group %s", g.name)
        group_rows, group_notes = _run_group(g, s, device)
        rows += group_rows
        notes += group_notes
        done.append(g.name)
    follow_up = (f"tools/benchmark.py bakeoff --groups {','.join(left)} --kv-heads-ratio {s.kv_heads_ratio} "
                 f"--tokens {s.tokens} --d-model {s.d_model} --budget-s {s.budget_s:.0f}" if left else None)
    return {
        **report_header("bakeoff", device_name(device)),
        "dtype": s.dtype,
        "d_model": s.d_model,
        "tokens": s.tokens,
        "kv_heads_ratio": s.kv_heads_ratio,
        "rounds": s.rounds,
        "warmup": s.warmup,
        "headline": s.rounds >= MIN_HEADLINE_PAIRS,
        "budget_s": s.budget_s,
        "elapsed_s": s.clock() - start,
        "fa4_disk_cache": os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1",
        "exactness": (f"output and every gradient within max(2 × same-precision eager error, {TOLERANCE_FLOOR}) of "
                      "the fp32 eager reference (relative to its largest value, non-zero)"),
        "timing": "exact candidates alternated call by call, order rotated each round; median over rounds",
        "groups_done": done,
        "groups_left": left,
        "follow_up": follow_up,
        "notes": notes,
        "results": rows,
    }


def bakeoff_report(result: dict) -> str:
    headers = ["group", "pe", "backend", "exact", "first call s", "fwd+bwd ms", "TFLOP/s"]
    table = []
    for r in result["results"]:
        group = f"{r['head_dim']}:{r['seq_len']}:{'docs' if r['docs'] else 'plain'}"
        exact = "error" if "error" in r else ("yes" if r.get("exact") else "NO")
        table.append([group, r["pe"], r["backend"], exact, r.get("first_call_s"), r.get("fwd_bwd_ms"),
                      r.get("fwd_bwd_tflops")])
    lines = [f"bakeoff: {result['device']}, {result['dtype']}, d_model {result['d_model']}, {result['tokens']} tokens "
             f"a batch, kv ratio {result['kv_heads_ratio']}; median of {result['rounds']} alternated rounds",
             format_table(headers, table)]
    lines += [f"  failed: {r['head_dim']}:{r['seq_len']} {r['pe']}/{r['backend']}: {r['error']}"
              for r in result["results"] if "error" in r]
    if result["groups_left"]:
        lines.append(f"left for a follow-up call (budget {result['budget_s']:.0f}s): {result['follow_up']}")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)
