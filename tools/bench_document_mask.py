"""SDPA (boolean mask) vs FlexAttention (document BlockMask) for packed documents: one attention call with
TAPE's [V ‖ E] values, forward (and with --backward the backward too), alternated round by round so every variant
sees the same machine load. flex-compiled is torch.compile(flex_attention) (no backward on CPU in torch 2.13),
flex-eager its unfused reference.

    python tools/bench_document_mask.py --length 2048 --docs 8 --rounds 5 [--backward] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tapetrain.model.attention import sdpa_attention
from tapetrain.model.documents import DocumentMask
from tapetrain.model.flex import flex_document_attention


def _inputs(b: int, h: int, t: int, d: int, docs: int, device: str):
    gen = torch.Generator().manual_seed(0)
    q, k, v, e = (torch.randn(b, h, t, d, generator=gen).to(device).requires_grad_() for _ in range(4))
    cuts = torch.sort(torch.randperm(t - 1, generator=gen)[: docs - 1] + 1).values
    ids = torch.zeros(t, dtype=torch.int32)
    ids[cuts] = 1
    return q, k, v, e, DocumentMask.of(ids.cumsum(0).to(torch.int32).expand(b, t).to(device))


def _step(fn, q, k, v, e, mask, backward: bool) -> None:
    mask = DocumentMask(mask.q_ids, mask.k_ids)  # a fresh mask every call: flex's BlockMask build is timed too
    if not backward:  # flex refuses inputs that require grad on CPU
        q, k, v, e = (x.detach() for x in (q, k, v, e))
    with torch.set_grad_enabled(backward):
        out, out_e = fn(q, k, v, e, docs=mask)
    if backward:
        (out.sum() + out_e.sum()).backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backward", action="store_true", help="time forward + backward (no flex-compiled on CPU)")
    args = ap.parse_args()
    tensors = _inputs(args.batch, args.heads, args.length, args.head_dim, args.docs, args.device)
    fns = {
        "sdpa": sdpa_attention,
        "flex-compiled": lambda *a, **kw: flex_document_attention(*a, compiled=True, **kw),
        "flex-eager": lambda *a, **kw: flex_document_attention(*a, compiled=False, **kw),
    }
    if args.backward and args.device == "cpu":
        fns = {"sdpa": sdpa_attention}  # FlexAttention has no backward on CPU (torch 2.13): nothing to compare
    for fn in fns.values():  # warm-up (flex compiles here)
        _step(fn, *tensors, args.backward)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            _step(fn, *tensors, args.backward)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    what = "fwd+bwd" if args.backward else "fwd"
    for name, ts in times.items():
        print(
            f"{name}: median {1000 * statistics.median(ts):.1f} ms over {args.rounds} rounds ({what}, "
            f"B={args.batch} H={args.heads} T={args.length} D={args.head_dim} [V‖E] width {2 * args.head_dim}, "
            f"{args.docs} documents, {args.device})"
        )


if __name__ == "__main__":
    main()
