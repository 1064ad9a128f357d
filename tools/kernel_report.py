#!/usr/bin/env python
"""Registers, spills and shared memory of every fused kernel, for A100 and H100, without a GPU.

  python tools/kernel_report.py --out R.json [--all-configs] [--candidates] [--archs 80,90] [--head-dims 64,128]
  python tools/kernel_report.py --check docs/benchmarks/kernel-report.json             # stale configs? (seconds)
  python tools/kernel_report.py --check docs/benchmarks/kernel-report.json --compile   # and every figure (ptxas)

Every kernel module in KERNEL_MODULES has `report_launches(arch, dtype) -> list[tapetrain.kernels.launch.Launch]`:
its launches at model shapes, run on meta tensors, with the configs its runtime would try on that arch. For each arch
(sm_80, sm_90a) and dtype (bf16, fp16) this compiles them for the target (tapetrain.kernels.ptx_report) and reads
`ptxas -v`. By default only the config the runtime tries first is compiled; --all-configs compiles the fallbacks
too; --candidates the tuning candidates a launch carries (the TAPE attention kernels' Hopper search space, for
tools/tune_attention.py to time the zero-spill ones). Records: kernel ("module.kernel_function"), arch, dtype, the
launch's labels (head_dim and case for attention, shape for the state-update kernels), config (BLOCK_*, num_warps,
num_stages), chosen (the runtime's first config), candidate, registers, spill_store_bytes, spill_load_bytes,
stack_frame_bytes, shared_bytes, shared_limit. Prints a table; exit status 1 if any chosen config spills or exceeds
the arch's shared memory. --head-dims filters the attention launches; the others have no head-dim label.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real GPU targets, not the CPU interpreter

import torch  # noqa: E402 - after the TRITON_INTERPRET reset

from tapetrain import atomic_io  # noqa: E402
from tapetrain.kernels import ptx_report  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KERNEL_MODULES = (
    "tapetrain.kernels.tape_attention",
    "tapetrain.kernels.tape_mlp_update",
    "tapetrain.kernels.tape_rotation",
    "tapetrain.kernels.tape_head_mix",
)
FIGURES = ("registers", "spill_store_bytes", "spill_load_bytes", "shared_bytes")


def arch_name(arch: int) -> str:
    return ptx_report.PTXAS_NAME[arch]


def captured(archs: list[int], dtypes: list[str], head_dims: list[int]) -> list[tuple[str, int, str, object]]:
    """(module short name, arch, dtype, Launch) for every launch of every kernel module."""
    found = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        for arch in archs:
            for dt in dtypes:
                for launch in module.report_launches(arch, DTYPES[dt]):
                    if launch.labels.get("head_dim", head_dims[0]) in head_dims:
                        found.append((name.rsplit(".", 1)[-1], arch, dt, launch))
    return found


def jobs_of(launches: list[tuple], all_configs: bool, candidate_dtypes: list[str]) -> list[tuple]:
    """(module, arch, dtype, launch, config) to compile: the chosen config of each launch, its fallbacks if
    all_configs, its candidates in candidate_dtypes (each config once)."""
    jobs = []
    for module, arch, dt, launch in launches:
        configs = launch.configs if all_configs else launch.configs[:1]
        configs = configs + (launch.candidates if dt in candidate_dtypes else [])
        for config in dict.fromkeys(configs):
            jobs.append((module, arch, dt, launch, config))
    return jobs


def identity(module: str, arch: int, dt: str, launch, config) -> dict:
    """What a record says about which kernel ran where with which launch config (no compiler output)."""
    return {
        "kernel": f"{module}.{launch.name}",
        "arch": arch_name(arch),
        "dtype": dt,
        **launch.labels,
        "config": config.as_dict(),
        "chosen": config == launch.configs[0],
        "candidate": config in launch.candidates,
    }


def compile_job(job: tuple) -> dict:
    """The job's record with ptxas' figures."""
    module, arch, dt, launch, config = job
    consts = dict(launch.consts, **dict(config.blocks))
    ptx, shared = ptx_report.compile_ptx(launch.kernel, launch.args, consts, arch, config.num_warps, config.num_stages)
    res = ptx_report.ptxas_resources(ptx, arch, shared)
    return {**identity(*job), **res.to_dict(), "shared_limit": ptx_report.SHARED_LIMIT[arch]}


def report(archs: list[int], head_dims: list[int], dtypes: list[str], all_configs: bool,
           candidate_dtypes: list[str]) -> list[dict]:  # fmt: skip
    from tqdm import tqdm

    jobs = jobs_of(captured(archs, dtypes, head_dims), all_configs, candidate_dtypes)
    return [compile_job(job) for job in tqdm(jobs, desc="compile + ptxas", leave=False)]


def launch_key(r: dict) -> tuple:
    """A launch in a report: kernel, arch, dtype and its labels (everything but the config and the figures)."""
    labels = tuple((k, r[k]) for k in r if k not in {"kernel", "arch", "dtype", "config", "chosen", "candidate",
                                                    "shared_limit", "stack_frame_bytes", *FIGURES})  # fmt: skip
    return (r["kernel"], r["arch"], r["dtype"], *labels)


def record_key(r: dict) -> tuple:
    return (*launch_key(r), config_text(r["config"]))


def key_text(key: tuple) -> str:
    return " ".join([*key[:3], *(f"{k}={v}" for k, v in key[3:])])


def config_text(config: dict) -> str:
    return ",".join(str(v) for v in config.values())


def scope_of(records: list[dict]) -> tuple[list[int], list[str], list[int]]:
    """The archs, dtypes and head dims a report covers."""
    archs = sorted({int(r["arch"][3:5]) for r in records})
    dtypes = sorted({r["dtype"] for r in records})
    head_dims = sorted({r["head_dim"] for r in records if "head_dim" in r}) or [0]
    return archs, dtypes, head_dims


def stale_records(path: Path) -> list[str]:
    """Differences between a report's configs (chosen and candidates) and the ones the runtime gives today, for the
    archs, head dims and dtypes the report covers (launch code on meta tensors only: no compiler, seconds)."""
    report = json.loads(path.read_text())
    records = report["records"]
    current = [identity(*job) for job in jobs_of(captured(*scope_of(records)), False, list(DTYPES))]
    candidate_dtypes = set(report.get("candidate_dtypes", []))
    problems_found = []
    if any(r["candidate"] for r in current) and not candidate_dtypes:
        problems_found.append("the report lists no tuning candidates (generate it with --candidates bf16)")
    for role in ("chosen", "candidate"):
        # candidates: only in the dtypes the report searched (a chosen config is a candidate in every dtype)
        def covers(r: dict, role: str = role) -> bool:
            return bool(r.get(role)) and (role == "chosen" or r["dtype"] in candidate_dtypes)

        then = _configs_by_launch([r for r in records if covers(r)])
        now = _configs_by_launch([r for r in current if covers(r)])
        for key in then.keys() | now.keys():
            if key not in now:
                problems_found.append(f"{key_text(key)}: in the report, no longer launched")
            elif key not in then:
                what = "launched" if role == "chosen" else f"{len(now[key])} candidates launched"
                problems_found.append(f"{key_text(key)}: {what}, missing from the report")
            elif sorted(map(config_text, then[key])) != sorted(map(config_text, now[key])):
                if role == "chosen":
                    problems_found.append(f"{key_text(key)}: report {then[key][0]}, runtime {now[key][0]}")
                else:
                    gone = [config_text(c) for c in then[key] if c not in now[key]]
                    new = [config_text(c) for c in now[key] if c not in then[key]]
                    problems_found.append(f"{key_text(key)}: candidates differ (report only: {gone}; runtime "
                                          f"only: {new})")  # fmt: skip
    return sorted(set(problems_found))


def _configs_by_launch(records: list[dict]) -> dict[tuple, list[dict]]:
    found: dict[tuple, list[dict]] = {}
    for r in records:
        found.setdefault(launch_key(r), []).append(r["config"])
    return found


def changed_figures(path: Path) -> list[str]:
    """Every record of the report whose config the runtime still launches, compiled again: the ones whose registers,
    spills or shared memory differ (ptxas; minutes without triton's cache)."""
    from tqdm import tqdm

    records = json.loads(path.read_text())["records"]
    jobs = {record_key(identity(*job)): job for job in jobs_of(captured(*scope_of(records)), True, list(DTYPES))}
    found = []
    for r in tqdm(records, desc="compile + ptxas", leave=False):
        job = jobs.get(record_key(r))
        if job is None:
            continue  # no longer launched: stale_records names it
        now = compile_job(job)
        diff = [f"{k} {r[k]} -> {now[k]}" for k in FIGURES if r[k] != now[k]]
        if diff:
            found.append(f"{key_text(launch_key(r))} config {config_text(r['config'])}: {', '.join(diff)}")
    return found


def problems(records: list[dict]) -> list[dict]:
    return [
        r
        for r in records
        if r["chosen"] and (r["spill_store_bytes"] or r["spill_load_bytes"] or r["shared_bytes"] > r["shared_limit"])
    ]


def table(records: list[dict]) -> str:
    """One line per record; flags: * = the runtime's chosen config, c = a tuning candidate."""
    rows = [(r["kernel"], r["arch"], r["dtype"], " ".join(str(v) for _, v in launch_key(r)[3:]),
             config_text(r["config"]), ("*" if r["chosen"] else "") + ("c" if r["candidate"] else ""),
             str(r["registers"]), f"{r['spill_store_bytes']}/{r['spill_load_bytes']}",
             f"{r['shared_bytes'] / 1024:.1f}") for r in records]  # fmt: skip
    head = ("kernel", "arch", "dtype", "launch", "config (BLOCK_*,w,s)", "", "regs", "spill st/ld", "smem KB")
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in [head, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path)
    p.add_argument("--archs", default="80,90")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--all-configs", action="store_true", help="also compile the fallback configs")
    p.add_argument("--candidates", default="", metavar="DTYPES",
                   help="also compile the launches' tuning candidates in these dtypes (e.g. bf16)")
    p.add_argument("--check", type=Path, metavar="REPORT",
                   help="compare REPORT's chosen and candidate configs with the runtime's (no ptxas); exit 1 when "
                        "stale")  # fmt: skip
    p.add_argument("--compile", action="store_true",
                   help="with --check: also compile every record again and compare registers, spills, shared memory")
    args = p.parse_args(argv)
    if args.check:
        stale = stale_records(args.check)
        if args.compile and not stale:
            stale = changed_figures(args.check)
        for line in stale:
            print(line)
        if stale:
            print(f"{args.check} is stale ({len(stale)} difference(s)); regenerate it: make kernel-report")
            return 1
        checked = "configs and figures" if args.compile else "chosen and candidate configs"
        print(f"{args.check}: its {checked} are the runtime's")
        return 0
    if not ptx_report.find_ptxas():
        print("kernel_report: no ptxas in the triton wheel; install triton (pip install triton)", file=sys.stderr)
        return 2
    dtypes = args.dtypes.split(",")
    candidate_dtypes = [dt for dt in args.candidates.split(",") if dt]
    records = report([int(x) for x in args.archs.split(",")], [int(x) for x in args.head_dims.split(",")], dtypes,
                     args.all_configs, candidate_dtypes)  # fmt: skip
    print(table(records))
    bad = problems(records)
    import triton

    if args.out:
        result = {"triton": triton.__version__, "candidate_dtypes": candidate_dtypes, "records": records,
                  "problems": len(bad)}  # fmt: skip
        atomic_io.write_text(args.out, json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    if bad:
        print(f"{len(bad)} chosen config(s) spill registers or exceed shared memory")
        return 1
    print("every chosen config: zero spills, shared memory within the arch's limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
