#!/usr/bin/env python
"""Sweep launch configs of the fused TAPE attention kernels on a GPU and report the fastest per kernel.

  python tools/tune_attention.py [--head-dims 64,128] [--dtypes bf16] [--seq-len 4096] [--out R.json]

Each kernel (fwd, dq, dkdv, de) is timed on its own (triton.testing.do_bench, median) for every candidate
(BLOCK_M, BLOCK_N, num_warps, num_stages), the other kernels untouched; configs that do not fit the GPU are
recorded as such. The candidates are tape_attention.HOPPER_CANDIDATES; on Hopper only those that the kernel report
(--report, docs/benchmarks/kernel-report.json, made with --candidates) found free of register spills and within
shared memory for sm_90a at that head dim and dtype. The winners are what tapetrain/kernels/tape_attention.py's
config table should list first. A time budget per (kernel, head dim, dtype) keeps the sweep inside a short GPU
lease: candidates are ordered so the likely winners come first.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from tapetrain import atomic_io

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


REPORT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "kernel-report.json"


def as_tuple(config: dict) -> tuple[int, int, int, int]:
    return config["BLOCK_M"], config["BLOCK_N"], config["num_warps"], config["num_stages"]


def candidates(kind: str, arch: int, d: int, dtype_name: str, report: Path) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) to time for `kind` at head dim d (TAPE case), likely winners
    first: on Hopper the zero-spill HOPPER_CANDIDATES of the kernel report, elsewhere all of them."""
    from tapetrain.kernels import tape_attention as km

    every = [as_tuple(c.as_dict()) for c in km.HOPPER_CANDIDATES[kind]]
    if arch // 10 != 9:
        return every
    kernel = f"tape_attention.{km.LAUNCH_NAMES[kind]}"
    records = [r for r in json.loads(report.read_text())["records"] if r.get("candidate") and r["kernel"] == kernel
               and r["arch"] == "sm_90a" and r["head_dim"] == d and r["dtype"] == dtype_name and r["case"] == "tape"]
    if not records:
        print(f"{report}: no sm_90a candidates for {kind} D={d} {dtype_name}; timing all {len(every)}", flush=True)
        return every
    fits = {as_tuple(r["config"]) for r in records if not (r["spill_store_bytes"] or r["spill_load_bytes"])
            and r["shared_bytes"] <= r["shared_limit"]}  # fmt: skip
    return [c for c in every if c in fits]


def attention_flops(kind: str, b: int, h: int, t: int, d: int) -> float:
    """Causal model FLOPs of one kernel with values [V ‖ E] (value width 2D)."""
    pairs = b * h * t * t / 2
    if kind == "fwd":
        return 2 * pairs * (d + 2 * d)
    if kind == "dq":  # recompute QK^T, dP over 2D, dQ
        return 2 * pairs * (d + 2 * d + d)
    if kind == "de":  # the de pass is timed together with the dk/dv pass it follows: the whole key-side backward
        return 2 * pairs * (d + 2 * d + 2 * d + d + d + d)
    return 2 * pairs * (d + 2 * d + 2 * d + d)  # recompute, dV/dE, dP, dK


def sweep(d: int, dtype_name: str, args: argparse.Namespace) -> dict:
    import triton
    from triton.testing import do_bench

    from tapetrain.kernels import tape_attention as km

    dtype = DTYPES[dtype_name]
    b, h, t = args.batch, args.heads, args.seq_len
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd() -> torch.Tensor:
        return torch.randn(b, h, t, d, generator=gen, device="cuda").to(dtype)

    q, k, v, e, do, doe = (rnd() for _ in range(6))
    scale = 1.0 / math.sqrt(d)
    o, oe, lse = km._forward(q, k, v, e, True, scale)
    runs = {
        "fwd": lambda: km._forward(q, k, v, e, True, scale),
        "dq": lambda: km._backward_impl(q, k, v, e, o, oe, lse, do, doe, True, scale, (True, False, False, False)),
        "dkdv": lambda: km._backward_impl(q, k, v, e, o, oe, lse, do, doe, True, scale, (False, True, True, True)),
    }
    arch = 10 * torch.cuda.get_device_capability()[0] + torch.cuda.get_device_capability()[1]
    if km._split_de(arch, d, dtype):  # de has its own pass here: sweep it too (timed with the dk/dv pass)
        runs["de"] = runs["dkdv"]
    runs = {kind: fn for kind, fn in runs.items() if kind in args.kernels}
    records = []
    for kind, fn in runs.items():
        deadline = time.monotonic() + args.budget_s
        for cfg in candidates(kind, arch, d, dtype_name, args.report):
            if time.monotonic() > deadline:
                break
            km.force_config(kind, cfg)
            rec = {"head_dim": d, "dtype": dtype_name, "kernel": kind, "config": list(cfg)}
            try:
                ms = do_bench(fn, warmup=10, rep=40, return_mode="median")
                rec.update(ms=ms, tflops=attention_flops(kind, b, h, t, d) / ms / 1e9)
            except (triton.runtime.errors.OutOfResources, RuntimeError) as err:
                rec["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            records.append(rec)
            print(json.dumps(rec), flush=True)
        km.force_config(kind, None)
    best = {}
    for kind in runs:
        timed = [r for r in records if r["kernel"] == kind and "ms" in r]
        if timed:
            best[kind] = min(timed, key=lambda r: r["ms"])
    return {"records": records, "best": best}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=40.0, help="seconds per (kernel, head dim, dtype)")
    p.add_argument("--kernels", type=lambda x: x.split(","), default=["fwd", "dq", "dkdv", "de"])
    p.add_argument("--report", type=Path, default=REPORT, help="kernel report with the candidates' ptxas figures")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    result = {
        "device": torch.cuda.get_device_name(),
        "shape": {"batch": args.batch, "heads": args.heads, "seq_len": args.seq_len, "causal": True},
        "runs": [],
    }
    for d in (int(x) for x in args.head_dims.split(",")):
        for dt in args.dtypes.split(","):
            run = sweep(d, dt, args)
            result["runs"].append({"head_dim": d, "dtype": dt, **run})
            for kind, rec in run["best"].items():
                print(f"best D={d} {dt} {kind}: {rec['config']} {rec['ms']:.3f} ms {rec['tflops']:.0f} TFLOP/s")
    if args.out:
        atomic_io.write_text(args.out, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
