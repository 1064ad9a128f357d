"""summary.md of a GPU campaign (tools/gpu_check.sh OUT_DIR): each stage, each test's result, each figure against
its target, and what the kernel record says. Reads only what the campaign wrote into OUT_DIR.

    python tools/gpu_summary.py OUT_DIR > OUT_DIR/summary.md
    python tools/gpu_summary.py --last-failed     # node ids that failed in the newest committed campaign
    python tools/gpu_summary.py OUT_DIR --targets-only   # the figures table alone (docs/performance.md embeds it)
    python tools/gpu_summary.py --memory-model    # today's memory model against every committed GPU layer JSON
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


def _cases(out: Path) -> list[ET.Element]:
    """The campaign's test cases, each once: a rerun's result replaces the first (tapetrain.junit_cases)."""
    from tapetrain.junit_cases import newest_cases  # the repository is on PYTHONPATH, as in gpu_check.sh

    return newest_cases(sorted(out.glob("gpu-tests*.xml")))


def test_lines(out: Path) -> tuple[list[str], dict[str, int]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    lines = ["| test | result | detail |", "|---|---|---|"]
    for case in _cases(out):
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
    # the fused E updates' runs (model.tape_fused_updates=true) exist only in campaigns that had those stages
    for name, optional in (("train-llama-1b-compile.json", False), ("train-llama-1b-compile-fused.json", True),
                           ("train-paper-155m-compile.json", False), ("train-paper-155m-compile-fused.json", True)):
        data = _json(out / name)
        if not data:
            if not optional:
                lines.append(f"| TAPE/RoPE step ({name}) | not measured | ≤ {STEP_RATIO_TARGET} | – | {name} |")
            continue
        ratio = data.get("tape_over_rope_step_time")
        pairs = data.get("pairs", data.get("steps"))
        fused = "fused" in (data.get("attention_ran") or {}).get("tape_updates", ())  # what ran, not what was asked
        where = f"{data['preset']} @{data['seq_len']}, {pairs} pairs" + (", fused E updates" if fused else "")
        if ratio is not None:
            met = "yes" if ratio <= STEP_RATIO_TARGET else "no"
            lines.append(f"| TAPE/RoPE step ({where}) | {ratio:.3f}× | ≤ {STEP_RATIO_TARGET}× | {met} | {name} |")
        mfu = (data.get("rope") or {}).get("mfu")
        if mfu is not None and (data["rope"].get("params") or 0) >= 3.5e8:  # the target is for ~350M-1B models
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
    # Campaigns before 2026-11-28 named the file verified-paths.json.
    data = _json(out / "kernel-record.json") or _json(out / "verified-paths.json")
    if not data:
        return ["(no kernel-record.json: the tests did not run, or the record stage was skipped)"]
    lines = [f"{data['device']} (sm_{data['capability'].replace('.', '')}), {data['date']}; "
             + ", ".join(f"{k} {v}" for k, v in data["versions"].items()), "",
             "| kind | backend | dtype | E | docs | GQA | passed |", "|---|---|---|---|---|---|---|"]
    for p in data["paths"]:
        lines.append(f"| {p['kind']} | {p['backend']} | {p['dtype']} | {p['e']} | {p['docs']} | {p['gqa']} | "
                     f"{'yes' if p['passed'] else 'NO'} |")
    return lines


def layer_estimate_gib(data: dict) -> float:
    """Today's memory model (tapetrain.train.memory.layer_activation_bytes) for the layer a `benchmark.py layer` JSON
    measured: its preset, PE, length, batch, dtype, MLP tiling and attention path. JSONs from before the path was
    recorded ran `auto` on Hopper, i.e. cuDNN's SDPA."""
    from tapetrain.bench.common import DTYPES
    from tapetrain.model import preset_config
    from tapetrain.train.memory import layer_activation_bytes

    chunks = data.get("tiled_mlp_chunks") or 1
    cfg = preset_config(data["preset"], pe=data["pe"], max_seq_len=data["seq_len"], tiled_mlp=chunks)
    value_bytes = DTYPES[data["dtype"]].itemsize
    est = layer_activation_bytes(cfg, data["batch"], data["seq_len"], value_bytes, cfg.updates_tape_state(1), chunks,
                                 attention=data.get("attention_path") or "sdpa")  # fmt: skip
    return est / 2**30


def memory_model_lines(root: Path = Path("docs/benchmarks/gpu")) -> list[str]:
    """One row per committed GPU layer measurement: measured saved bytes, today's estimate, their ratio."""
    lines = ["| file | device | tokens | measured GiB | model GiB | measured / model |", "|---|---|---|---|---|---|"]
    for path in sorted(root.glob("*/layer-*.json")):
        data = json.loads(path.read_text())
        measured = data["per_layer_measured_gb"]["saved_bytes"]
        est = layer_estimate_gib(data)
        lines.append(f"| {path.relative_to(root)} | {data['device']} | {data['seq_len']} | {measured:.3f} | {est:.3f} "
                     f"| {measured / est:.3f} |")
    return lines


def last_failed(root: Path = Path("docs/benchmarks/gpu")) -> list[str]:
    """pytest node ids of the tests that failed in the newest campaign directory (named DEVICE-YYYY-MM-DD) with a
    junit XML: the campaign runs them first."""
    dirs = [d for d in root.iterdir() if d.is_dir() and list(d.glob("gpu-tests*.xml"))]
    if not dirs:
        return []
    newest = max(dirs, key=lambda d: (d.name[-10:], d.name))
    failed = []
    for case in _cases(newest):
        if case.find("failure") is not None or case.find("error") is not None:
            module = case.get("classname", "").replace(".", "/")
            failed.append(f"{module}.py::{case.get('name')}")
    return failed


def main(argv: list[str]) -> int:
    if argv == ["--memory-model"]:
        print("\n".join(memory_model_lines()))
        return 0
    if argv == ["--last-failed"]:
        print(" ".join(last_failed()))
        return 0
    if len(argv) == 2 and argv[1] == "--targets-only":
        print("\n".join(target_lines(Path(argv[0]))))
        return 0
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
