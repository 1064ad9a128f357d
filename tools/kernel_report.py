#!/usr/bin/env python
"""Registers, spills and shared memory of every fused-attention kernel, for A100 and H100, without a GPU.

  python tools/kernel_report.py --out R.json [--all-configs] [--archs 80,90] [--head-dims 64,128]

For each arch (sm_80, sm_90a) × head dim (64, 128) × dtype (bf16, fp16) × case (TAPE: values V and E with
Dv = De = D; plain: values only) it runs the kernels' launch code on meta tensors, records the launches and the
configs the runtime would try, compiles them for the target (tapetrain.kernels.ptx_report) and reads `ptxas -v`.
By default only the config the runtime chooses first is compiled; --all-configs compiles the fallbacks too.
Writes JSON records (kernel, arch, head_dim, dtype, case, config, registers, spill_store_bytes,
spill_load_bytes, shared_bytes, shared_limit) and prints a table. Exit status 1 if any chosen config spills or
exceeds the arch's shared memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real GPU targets, not the CPU interpreter

import torch  # noqa: E402 - after the TRITON_INTERPRET reset

from tapetrain.kernels import ptx_report  # noqa: E402
from tapetrain.kernels import tape_attention as km  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KERNEL_NAMES = {"fwd": "_fwd_kernel", "dq": "_bwd_dq_kernel", "dkdv": "_bwd_dkdv_kernel", "de": "_bwd_dkdv_kernel:de"}


def launches(arch: int, head_dim: int, dtype: torch.dtype, tape: bool) -> list[dict]:
    """The kernel launches of one forward + backward at a representative training shape, on meta tensors, in the
    token-major layout the model uses (B, T, H, D memory viewed as B, H, T, D)."""
    b, h, t = 2, 16, 1024

    def tensor() -> torch.Tensor:
        return torch.empty(b, t, h, head_dim, device="meta", dtype=dtype).transpose(1, 2)

    q, k, v, do = tensor(), tensor(), tensor(), tensor()
    e, doe = (tensor(), tensor()) if tape else (None, None)
    capture = km.capture_launches(arch)
    try:
        scale = 1.0 / math.sqrt(head_dim)
        o, oe, lse = km._forward(q, k, v, e, True, scale)
        km._backward_impl(q, k, v, e, o, oe, lse, do, doe, True, scale, (True, True, True, tape))
    finally:
        km.stop_capture()
    return capture.launches


def report(archs: list[int], head_dims: list[int], dtypes: list[str], all_configs: bool) -> list[dict]:
    from tqdm import tqdm

    jobs = []
    for arch in archs:
        for d in head_dims:
            for dt in dtypes:
                for tape in (True, False):
                    for launch in launches(arch, d, DTYPES[dt], tape):
                        cfgs = launch["configs"] if all_configs else launch["configs"][:1]
                        for rank, cfg in enumerate(cfgs):
                            jobs.append((arch, d, dt, tape, launch, rank, cfg))
    records = []
    for arch, d, dt, tape, launch, rank, cfg in tqdm(jobs, desc="compile + ptxas", leave=False):
        bm, bn, warps, stages = cfg
        consts = dict(launch["consts"], BLOCK_M=bm, BLOCK_N=bn)
        ptx, shared = ptx_report.compile_ptx(launch["kernel"], launch["args"], consts, arch, warps, stages)
        res = ptx_report.ptxas_resources(ptx, arch, shared)
        records.append(
            {
                "kernel": KERNEL_NAMES[launch["kind"]],
                "arch": f"sm_{arch}" + ("a" if arch == 90 else ""),
                "head_dim": d,
                "dtype": dt,
                "case": "tape" if tape else "plain",
                "config": {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages},
                "chosen": rank == 0,
                **res.to_dict(),
                "shared_limit": ptx_report.SHARED_LIMIT[arch],
            }
        )
    return records


def problems(records: list[dict]) -> list[dict]:
    return [
        r
        for r in records
        if r["chosen"] and (r["spill_store_bytes"] or r["spill_load_bytes"] or r["shared_bytes"] > r["shared_limit"])
    ]


def table(records: list[dict]) -> str:
    head = f"{'kernel':17s} {'arch':7s} {'D':>4s} {'dtype':5s} {'case':5s} {'config (BM,BN,w,s)':19s} " \
           f"{'regs':>4s} {'spill st/ld':>12s} {'smem KB':>8s}"  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in records:
        c = r["config"]
        cfg = f"({c['BLOCK_M']},{c['BLOCK_N']},{c['num_warps']},{c['num_stages']})" + ("" if r["chosen"] else " fb")
        lines.append(
            f"{r['kernel']:17s} {r['arch']:7s} {r['head_dim']:4d} {r['dtype']:5s} {r['case']:5s} {cfg:19s} "
            f"{r['registers']:4d} {r['spill_store_bytes']:>5d}/{r['spill_load_bytes']:<6d} "
            f"{r['shared_bytes'] / 1024:8.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path)
    p.add_argument("--archs", default="80,90")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--all-configs", action="store_true", help="also compile the fallback configs")
    args = p.parse_args(argv)
    if not ptx_report.find_ptxas():
        print("kernel_report: no ptxas in the triton wheel; install triton (pip install triton)", file=sys.stderr)
        return 2
    records = report(
        [int(x) for x in args.archs.split(",")],
        [int(x) for x in args.head_dims.split(",")],
        args.dtypes.split(","),
        args.all_configs,
    )
    print(table(records))
    bad = problems(records)
    import triton

    if args.out:
        result = {"triton": triton.__version__, "records": records, "problems": len(bad)}
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(args.out)
        print(f"wrote {args.out}")
    if bad:
        print(f"{len(bad)} chosen config(s) spill registers or exceed shared memory")
        return 1
    print("every chosen config: zero spills, shared memory within the arch's limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
