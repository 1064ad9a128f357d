"""summary.md of a GPU campaign (tools/gpu_check.sh OUT_DIR): each stage, each test's result, each figure against
its target, and what the verified-paths record says. Reads only what the campaign wrote into OUT_DIR.

    python tools/gpu_summary.py OUT_DIR > OUT_DIR/summary.md
"""

from __future__ import annotations

import csv
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# The targets (README "Performance"): TAPE's train step against RoPE's, RoPE's MFU, the memory model's error bound.
STEP_RATIO_TARGET = 1.10
ROPE_MFU_TARGET = 0.45
MEMORY_MODEL_BOUND = 0.10  # |measured / estimate − 1| per layer (saved bytes), docs/performance.md


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def stage_lines(out: Path) -> list[str]:
    lines = ["| stage | result | seconds | log |", "|---|---|---|---|"]
    try:
        rows = list(csv.DictReader((out / "summary.tsv").open(), delimiter="\t"))
    except FileNotFoundError:
        return ["(no summary.tsv)"]
    for row in rows:
        result = {"0": "ok", "skipped": "skipped (budget)"}.get(row["rc"], f"failed (rc {row['rc']})")
        lines.append(f"| {row['stage']} | {result} | {row['seconds']} | {row['log']} |")
    return lines


def test_lines(out: Path) -> tuple[list[str], dict[str, int]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    lines = ["| test | result | detail |", "|---|---|---|"]
    for xml in sorted(out.glob("gpu-tests*.xml")):
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').removeprefix('tests.')}::{case.get('name')}"
            failure = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped")
            if failure is not None:
                outcome, detail = "failed", (failure.get("message") or "").splitlines()[0][:160]
            elif skipped is not None:
                outcome, detail = "skipped", (skipped.get("message") or "")[:160]
            else:
                outcome, detail = "passed", f"{float(case.get('time', 0)):.1f} s"
            counts[outcome] += 1
            lines.append(f"| {name} | {outcome} | {detail.replace('|', '/')} |")
    return lines, counts


def target_lines(out: Path) -> list[str]:
    lines = ["| figure | measured | target | met | file |", "|---|---|---|---|---|"]
    for name in ("train-llama-1b-compile.json", "train-paper-155m-compile.json"):
        data = _json(out / name)
        if not data:
            lines.append(f"| TAPE/RoPE step ({name}) | not measured | ≤ {STEP_RATIO_TARGET} | – | {name} |")
            continue
        ratio = data.get("tape_over_rope_step_time")
        pairs = data.get("pairs", data.get("steps"))
        where = f"{data['preset']} @{data['seq_len']}, {pairs} pairs"
        if ratio is not None:
            met = "yes" if ratio <= STEP_RATIO_TARGET else "no"
            lines.append(f"| TAPE/RoPE step ({where}) | {ratio:.3f}× | ≤ {STEP_RATIO_TARGET}× | {met} | {name} |")
        mfu = (data.get("rope") or {}).get("mfu")
        if mfu is not None:
            met = "yes" if mfu >= ROPE_MFU_TARGET else "no"
            lines.append(f"| RoPE MFU ({where}) | {mfu:.1%} | ≥ {ROPE_MFU_TARGET:.0%} | {met} | {name} |")
    for layer in sorted(out.glob("layer-*.json")):
        data = _json(layer) or {}
        ratio = (data.get("measured_over_estimate") or {}).get("saved_bytes")
        if ratio is None:
            continue
        met = "yes" if abs(ratio - 1) <= MEMORY_MODEL_BOUND else "no"
        lines.append(f"| memory model, saved bytes per layer ({data['preset']} @{data['seq_len']}) | measured/estimate "
                     f"{ratio:.3f} | within ±{MEMORY_MODEL_BOUND:.0%} | {met} | {layer.name} |")
    return lines


def verified_lines(out: Path) -> list[str]:
    data = _json(out / "verified-paths.json")
    if not data:
        return ["(no verified-paths.json: the tests did not run, or the record stage was skipped)"]
    lines = [f"{data['device']} (sm_{data['capability'].replace('.', '')}), {data['date']}; "
             + ", ".join(f"{k} {v}" for k, v in data["versions"].items()), "",
             "| kind | backend | dtype | E | docs | GQA | passed |", "|---|---|---|---|---|---|---|"]
    for p in data["paths"]:
        lines.append(f"| {p['kind']} | {p['backend']} | {p['dtype']} | {p['e']} | {p['docs']} | {p['gqa']} | "
                     f"{'yes' if p['passed'] else 'NO'} |")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    tests, counts = test_lines(out)
    parts = [f"# GPU campaign: {out.name}", "", "## Stages", *stage_lines(out), "",
             "## Figures against their targets", *target_lines(out), "",
             f"## Tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped", *tests, "",
             "## Verified paths (what `auto` may pick on this GPU capability)", *verified_lines(out), ""]
    print("\n".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
