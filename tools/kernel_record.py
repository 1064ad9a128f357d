"""The kernel record that `auto` consults (tapetrain/model/kernel_record.py).

    python tools/kernel_record.py from-junit OUT/gpu-tests.xml [--bakeoff OUT/bakeoff.json] --out OUT/kernel-record.json
    python tools/kernel_record.py add-timings OUT/kernel-record.json OUT/bakeoff-more.json   # a follow-up's timings
    python tools/kernel_record.py merge OUT/kernel-record.json [--source docs/benchmarks/gpu/DIR/gpu-tests.xml]
    python tools/kernel_record.py show

`from-junit` runs on the GPU machine right after the gpu-marked tests (it reads the device, its capability and the
versions there), with the attention bake-off's JSON when it ran (its timings are what `auto` ranks by);
`add-timings` adds a follow-up call's bake-off; `merge` adds that campaign to tapetrain/model/kernel_record.json
(commit it); `show` prints what the committed record verifies and times.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import sys
from pathlib import Path

from tapetrain.bench.campaign_record import add_timings, merge_campaign, record_from_junit
from tapetrain.bench.report import write_json_atomic
from tapetrain.model import kernel_record


def _versions() -> dict[str, str]:
    import torch

    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name in ("triton", "flash_attn", "liger_kernel", "transformers", "deepspeed"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception:  # an absent optional package is a fact to record, not an error
            out[name] = "absent"
    for dist in ("flash-attn-4", "nvidia-cutlass-dsl"):  # by distribution: importing CuTe DSL costs seconds
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "absent"
    return out


def _existing(paths: list[Path], what: str) -> list[Path]:
    missing = [p for p in paths if not p.exists()]
    if missing:  # a stage that did not get to write its file: record what the others saw
        print(f"not found ({what}): {', '.join(map(str, missing))}", file=sys.stderr)
    return [p for p in paths if p.exists()]


def from_junit(xml: list[Path], out: Path, date: str, bakeoffs: list[Path] = ()) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("from-junit runs on the GPU machine that ran the tests (it records that device)")
    device = torch.device("cuda")
    xml = _existing(xml, "its tests verify nothing")
    campaign = record_from_junit(xml, device=torch.cuda.get_device_name(device),
                                 capability=kernel_record.capability_of(device), date=date, versions=_versions(),
                                 source=", ".join(p.name for p in xml))
    campaign = add_timings(campaign, [json.loads(p.read_text()) for p in _existing(list(bakeoffs), "no timings")])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(campaign, indent=1) + "\n")
    return campaign


def show() -> None:
    for campaign in kernel_record.campaigns():
        print(f"{campaign['date']}  {campaign['device']} (sm_{campaign['capability'].replace('.', '')})  "
              f"{', '.join(f'{k} {v}' for k, v in campaign['versions'].items())}")
        for entry in campaign["paths"]:
            feats = ",".join(k for k in ("e", "docs", "gqa") if entry.get(k)) or "-"
            print(f"  {'PASS' if entry['passed'] else 'FAIL'}  {entry['kind']:<11} {entry['backend']:<12} "
                  f"{entry['dtype']:<5} {feats}")
        for t in campaign.get("timings", ()):
            feats = ",".join(k for k in ("e", "docs", "gqa") if t.get(k)) or "-"
            timing = (f"{t['fwd_bwd_ms']:.3f} ms fwd+bwd, {t['fwd_bwd_tflops']:.0f} TFLOP/s" if t["exact"]
                      else "NOT EXACT (or failed)")
            print(f"  time  {t['backend']:<12} {t['dtype']:<5} D={t['head_dim']:<4} T={t['seq_len']:<6} {feats:<12} "
                  f"{timing}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("from-junit", help="a campaign record from the gpu tests' junit XML (on the GPU machine)")
    p.add_argument("xml", nargs="+", type=Path, help="junit XML of pytest -m gpu")
    p.add_argument("--out", type=Path, required=True, help="campaign record to write (JSON)")
    p.add_argument("--date", default=datetime.date.today().isoformat(), help="campaign date (default today)")
    p.add_argument("--bakeoff", nargs="*", type=Path, default=[], help="the attention bake-off's JSON (timings)")
    p = sub.add_parser("add-timings", help="add bake-off timings to a campaign record (a follow-up call's)")
    p.add_argument("campaign", type=Path, help="the kernel-record.json from-junit wrote")
    p.add_argument("bakeoff", nargs="+", type=Path, help="bake-off JSON files")
    p = sub.add_parser("merge", help="add a campaign record to tapetrain/model/kernel_record.json")
    p.add_argument("campaign", type=Path, help="the kernel-record.json a campaign wrote")
    p.add_argument("--source", help="where the campaign's evidence is committed (replaces its 'source')")
    p.add_argument("--record", type=Path, default=kernel_record.RECORD_FILE, help="record to merge into")
    sub.add_parser("show", help="print what the record verifies")
    args = parser.parse_args(argv)
    if args.command == "from-junit":
        campaign = from_junit(args.xml, args.out, args.date, args.bakeoff)
        print(f"{len(campaign['paths'])} paths, {sum(e['passed'] for e in campaign['paths'])} passed, "
              f"{len(campaign['timings'])} timings -> {args.out}")
    elif args.command == "add-timings":
        campaign = add_timings(json.loads(args.campaign.read_text()),
                               [json.loads(p.read_text()) for p in args.bakeoff])
        write_json_atomic(args.campaign, campaign)
        print(f"{args.campaign}: {len(campaign['timings'])} timings")
    elif args.command == "merge":
        campaign = json.loads(args.campaign.read_text())
        if args.source:
            campaign["source"] = args.source
        record = merge_campaign(args.record, campaign)
        print(f"{args.record}: {len(record['campaigns'])} campaign(s)")
    else:
        show()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
