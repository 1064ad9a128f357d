#!/usr/bin/env python
"""Registers, spills and shared memory of every fused kernel, for A100 and H100, without a GPU.

  python tools/kernel_report.py --out R.json [--all-configs] [--archs 80,90] [--head-dims 64,128]
  python tools/kernel_report.py --check docs/benchmarks/kernel-report.json   # stale? (no ptxas, seconds)

For each arch (sm_80, sm_90a) × head dim (64, 128) × dtype (bf16, fp16) × case (TAPE: values V and E with
Dv = De = D; plain: values only) it runs the kernels' launch code on meta tensors, records the launches and the
configs the runtime would try, compiles them for the target (tapetrain.kernels.ptx_report) and reads `ptxas -v`.
By default only the config the runtime chooses first is compiled; --all-configs compiles the fallbacks too.
Writes JSON records (kernel, arch, head_dim, dtype, case, config, registers, spill_store_bytes,
spill_load_bytes, shared_bytes, shared_limit) and prints a table. Exit status 1 if any chosen config spills or
exceeds the arch's shared memory.

The TAPE state-update kernels come from the modules in KERNEL_MODULES (those that exist): each has
`report_launches(arch, dtype) -> list[dict]` giving its launches at model shapes with the config its runtime
chooses (record format: tapetrain.kernels.tape_mlp_update.report_launches). Their records carry `shape` (e.g.
"llama2-7b M=32 I=128 D=128") instead of head_dim and case, and the kernel as "module._kernel_name"; --head-dims
does not apply to them, --dtypes does.
"""

from __future__ import annotations

import argparse
import importlib
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
# Modules with report_launches(arch, dtype); the optional ones are reported when present.
KERNEL_MODULES = (
    "tapetrain.kernels.tape_mlp_update",
    "tapetrain.kernels.tape_rotation",
    "tapetrain.kernels.tape_head_mix",
)
REQUIRED_MODULES = ("tapetrain.kernels.tape_mlp_update",)
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


def jobs_of(archs: list[int], head_dims: list[int], dtypes: list[str], all_configs: bool) -> list[tuple]:
    """(arch, D, dtype, tape, launch, rank, config) for every launch of every case; rank 0 = the chosen config."""
    jobs = []
    for arch in archs:
        for d in head_dims:
            for dt in dtypes:
                for tape in (True, False):
                    for launch in launches(arch, d, DTYPES[dt], tape):
                        cfgs = launch["configs"] if all_configs else launch["configs"][:1]
                        for rank, cfg in enumerate(cfgs):
                            jobs.append((arch, d, dt, tape, launch, rank, cfg))
    return jobs


def kernel_modules() -> list:
    """The KERNEL_MODULES that exist (an optional one that is absent is skipped; any other import error is raised)."""
    found = []
    for name in KERNEL_MODULES:
        try:
            found.append(importlib.import_module(name))
        except ModuleNotFoundError as err:
            if err.name != name or name in REQUIRED_MODULES:
                raise
    return found


def module_jobs(archs: list[int], dtypes: list[str]) -> list[tuple[int, str, str, dict]]:
    """(arch, dtype, module short name, launch record) for every launch of every kernel module."""
    return [
        (arch, dt, mod.__name__.rsplit(".", 1)[-1], launch)
        for mod in kernel_modules()
        for arch in archs
        for dt in dtypes
        for launch in mod.report_launches(arch, DTYPES[dt])
    ]


def module_identity(arch: int, dt: str, module: str, launch: dict) -> dict:
    """A kernel module record without compiler output: its BLOCK_* constants, warps and stages are the config."""
    blocks = {k: v for k, v in launch["consts"].items() if k.startswith("BLOCK")}
    return {
        "kernel": f"{module}.{launch['name']}",
        "arch": f"sm_{arch}" + ("a" if arch == 90 else ""),
        "shape": launch["shape"],
        "dtype": dt,
        "config": {**blocks, "num_warps": launch["num_warps"], "num_stages": launch["num_stages"]},
        "chosen": True,
    }


def identity(arch: int, d: int, dt: str, tape: bool, launch: dict, rank: int, cfg: tuple) -> dict:
    """What a record says about which kernel ran where with which launch config (no compiler output)."""
    bm, bn, warps, stages = cfg
    return {
        "kernel": KERNEL_NAMES[launch["kind"]],
        "arch": f"sm_{arch}" + ("a" if arch == 90 else ""),
        "head_dim": d,
        "dtype": dt,
        "case": "tape" if tape else "plain",
        "config": {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages},
        "chosen": rank == 0,
    }


def report(archs: list[int], head_dims: list[int], dtypes: list[str], all_configs: bool) -> list[dict]:
    from tqdm import tqdm

    records = []
    for job in tqdm(jobs_of(archs, head_dims, dtypes, all_configs), desc="compile + ptxas", leave=False):
        arch, _, _, _, launch, _, (bm, bn, warps, stages) = job
        consts = dict(launch["consts"], BLOCK_M=bm, BLOCK_N=bn)
        ptx, shared = ptx_report.compile_ptx(launch["kernel"], launch["args"], consts, arch, warps, stages)
        res = ptx_report.ptxas_resources(ptx, arch, shared)
        records.append({**identity(*job), **res.to_dict(), "shared_limit": ptx_report.SHARED_LIMIT[arch]})
    for job in tqdm(module_jobs(archs, dtypes), desc="state-update kernels", leave=False):
        arch, launch = job[0], job[3]
        ptx, shared = ptx_report.compile_ptx(launch["kernel"], launch["args"], launch["consts"], arch,
                                             launch["num_warps"], launch["num_stages"])  # fmt: skip
        res = ptx_report.ptxas_resources(ptx, arch, shared)
        records.append({**module_identity(*job), **res.to_dict(), "shared_limit": ptx_report.SHARED_LIMIT[arch]})
    return records


def stale_records(path: Path) -> list[str]:
    """Differences between a report's chosen configs and the ones the runtime table chooses today, for the archs,
    head dims and dtypes the report covers (launch code on meta tensors only: no compiler, no ptxas, seconds)."""
    chosen = [r for r in json.loads(path.read_text())["records"] if r["chosen"]]
    recorded = [
        {key: r[key] for key in ("kernel", "arch", "head_dim", "dtype", "case", "config", "chosen")}
        for r in chosen
        if "head_dim" in r
    ]
    recorded += [
        {key: r[key] for key in ("kernel", "arch", "shape", "dtype", "config", "chosen")}
        for r in chosen
        if "shape" in r
    ]
    archs = sorted({int(r["arch"][3:5]) for r in chosen})
    head_dims = sorted({r["head_dim"] for r in recorded if "head_dim" in r})
    dtypes = sorted({r["dtype"] for r in chosen})
    current = [identity(*job) for job in jobs_of(archs, head_dims, dtypes, all_configs=False)]
    current += [module_identity(*job) for job in module_jobs(archs, dtypes)]

    def key(r: dict) -> tuple:
        if "shape" in r:
            return r["kernel"], r["arch"], r["shape"], r["dtype"]
        return r["kernel"], r["arch"], r["head_dim"], r["dtype"], r["case"]

    now = {key(r): r["config"] for r in current}
    then = {key(r): r["config"] for r in recorded}
    problems_found = [f"{' '.join(map(str, k))}: report {then[k]}, runtime {now[k]}" for k in then if k in now and
                      then[k] != now[k]]
    problems_found += [f"{' '.join(map(str, k))}: in the report, no longer launched" for k in then if k not in now]
    problems_found += [f"{' '.join(map(str, k))}: launched, missing from the report" for k in now if k not in then]
    return problems_found


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
        if "shape" in r:
            continue
        c = r["config"]
        cfg = f"({c['BLOCK_M']},{c['BLOCK_N']},{c['num_warps']},{c['num_stages']})" + ("" if r["chosen"] else " fb")
        lines.append(
            f"{r['kernel']:17s} {r['arch']:7s} {r['head_dim']:4d} {r['dtype']:5s} {r['case']:5s} {cfg:19s} "
            f"{r['registers']:4d} {r['spill_store_bytes']:>5d}/{r['spill_load_bytes']:<6d} "
            f"{r['shared_bytes'] / 1024:8.1f}"
        )
    modules = [r for r in records if "shape" in r]
    if modules:
        head = f"{'kernel':34s} {'arch':7s} {'shape':30s} {'dtype':5s} {'config (BT,BI,w,s)':19s} " \
               f"{'regs':>4s} {'spill st/ld':>12s} {'smem KB':>8s}"  # fmt: skip
        lines += ["", head, "-" * len(head)]
        for r in modules:
            c = r["config"]
            cfg = f"({c.get('BLOCK_T', '-')},{c.get('BLOCK_I', '-')},{c['num_warps']},{c['num_stages']})"
            lines.append(
                f"{r['kernel']:34s} {r['arch']:7s} {r['shape']:30s} {r['dtype']:5s} {cfg:19s} {r['registers']:4d} "
                f"{r['spill_store_bytes']:>5d}/{r['spill_load_bytes']:<6d} {r['shared_bytes'] / 1024:8.1f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path)
    p.add_argument("--archs", default="80,90")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--all-configs", action="store_true", help="also compile the fallback configs")
    p.add_argument("--check", type=Path, metavar="REPORT",
                   help="only compare REPORT's chosen configs with the runtime's (no ptxas); exit 1 when stale")
    args = p.parse_args(argv)
    if args.check:
        stale = stale_records(args.check)
        for line in stale:
            print(line)
        if stale:
            print(f"{args.check} is stale ({len(stale)} difference(s)); regenerate it: python tools/kernel_report.py "
                  f"--out {args.check}")
            return 1
        print(f"{args.check}: every chosen config is the runtime's")
        return 0
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
