"""The kernel record that `auto` consults (tapetrain/model/kernel_record.py).

    python tools/kernel_record.py from-junit OUT/gpu-tests.xml --out OUT/kernel-record.json   # on the GPU
    python tools/kernel_record.py merge OUT/kernel-record.json [--source docs/benchmarks/gpu/DIR/gpu-tests.xml]
    python tools/kernel_record.py show

`from-junit` runs on the GPU machine right after the gpu-marked tests (it reads the device, its capability and the
versions there); `merge` adds that campaign to tapetrain/model/kernel_record.json (commit it); `show` prints what
the committed record verifies.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys
from pathlib import Path

from tapetrain.bench.campaign_record import merge_campaign, record_from_junit
from tapetrain.model import kernel_record


def _versions() -> dict[str, str]:
    import torch

    out = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for name in ("triton", "flash_attn", "liger_kernel", "transformers", "deepspeed"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception:  # an absent optional package is a fact to record, not an error
            out[name] = "absent"
    return out


def from_junit(xml: list[Path], out: Path, date: str) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("from-junit runs on the GPU machine that ran the tests (it records that device)")
    device = torch.device("cuda")
    missing = [p for p in xml if not p.exists()]
    if missing:  # a test stage that did not get to write its XML: record what the others saw
        print(f"not found (its tests verify nothing): {', '.join(map(str, missing))}", file=sys.stderr)
        xml = [p for p in xml if p.exists()]
    campaign = record_from_junit(xml, device=torch.cuda.get_device_name(device),
                                 capability=kernel_record.capability_of(device), date=date, versions=_versions(),
                                 source=", ".join(p.name for p in xml))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(campaign, indent=1) + "\n")
    return campaign


def show() -> None:
    for campaign in kernel_record.campaigns():
        print(f"{campaign['date']}  {campaign['device']} (sm_{campaign['capability'].replace('.', '')})  "
              f"{', '.join(f'{k} {v}' for k, v in campaign['versions'].items())}")
        for entry in campaign["paths"]:
            feats = ",".join(k for k in ("e", "docs", "gqa") if entry.get(k)) or "-"
            print(f"  {'PASS' if entry['passed'] else 'FAIL'}  {entry['kind']:<9} {entry['backend']:<8} "
                  f"{entry['dtype']:<5} {feats}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("from-junit", help="a campaign record from the gpu tests' junit XML (on the GPU machine)")
    p.add_argument("xml", nargs="+", type=Path, help="junit XML of pytest -m gpu")
    p.add_argument("--out", type=Path, required=True, help="campaign record to write (JSON)")
    p.add_argument("--date", default=datetime.date.today().isoformat(), help="campaign date (default today)")
    p = sub.add_parser("merge", help="add a campaign record to tapetrain/model/kernel_record.json")
    p.add_argument("campaign", type=Path, help="the kernel-record.json a campaign wrote")
    p.add_argument("--source", help="where the campaign's evidence is committed (replaces its 'source')")
    p.add_argument("--record", type=Path, default=kernel_record.RECORD_FILE, help="record to merge into")
    sub.add_parser("show", help="print what the record verifies")
    args = parser.parse_args(argv)
    if args.command == "from-junit":
        campaign = from_junit(args.xml, args.out, args.date)
        print(f"{len(campaign['paths'])} paths, {sum(e['passed'] for e in campaign['paths'])} passed -> {args.out}")
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
