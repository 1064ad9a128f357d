#!/usr/bin/env python
"""Train and evaluate TAPE and its four arithmetic baselines (RoPE, RandPE, NoPE, FIRE) on addition, like for like.

    python tools/arith_compare.py --scale tiny  [--out arith-compare-tiny]          # 2 CPU cores
    python tools/arith_compare.py --scale paper --gpus 8 [--out arith-compare]       # the paper's recipe
    python tools/arith_compare.py --scale paper --gpus 1 --pes tape,rope --set train.steps=2000   # a GPU-hour budget

Every step is a public command: `tapetrain data arith` once, then per PE `tapetrain train` (under
`deepspeed --num_gpus N` when --gpus > 0) with only model.pe, run.out_dir and data.train changed, and
`tapetrain eval arith`. It writes OUT/summary.json, OUT/summary.md (one table: mean exact match in distribution,
out of distribution and on the whole grid per PE) and OUT/heatmaps.png (the heatmaps side by side). Steps whose
output exists are skipped, and an interrupted training run resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PES = ("tape", "rope", "randpe", "nope", "fire")
NAMES = {"tape": "TAPE", "rope": "RoPE", "randpe": "RandPE", "nope": "NoPE", "fire": "FIRE"}
# The paper's averages over the whole 2x heatmap (seed results; %).
PAPER = {"tape": 32.82, "fire": 26.98, "randpe": 26.56, "rope": 26.32, "nope": 22.45}
SCALES = {
    # operands up to 3 digits, grid to 6; the tiny recipe trains in minutes on 2 CPU cores
    "tiny": {"data": ["--max-digits", "3", "--eval-max-digits", "6", "--train-examples", "200000"],
             "config": "configs/arith-tiny-cpu.yaml"},
    # the paper: operands up to 20 digits, grid to 40 (defaults of `tapetrain data arith`)
    "paper": {"data": [], "config": "configs/arith-{pe}.yaml"},
}


def tapetrain() -> str:
    return shutil.which("tapetrain", path=str(BIN)) or f"{sys.executable} -m tapetrain.cli"


def run(title: str, cmd: list[str], timings: dict) -> None:
    print(f"[arith-compare] {title}:\n    $ {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if result.returncode != 0:
        raise SystemExit(f"arith-compare: '{title}' failed (exit {result.returncode}); fix the error above and re-run "
                         "(finished steps are skipped)")
    timings[title] = round(time.perf_counter() - start, 1)


def train_cmd(config: str, gpus: int, overrides: list[str]) -> list[str]:
    if gpus > 0:
        launcher = shutil.which("deepspeed", path=str(BIN)) or "deepspeed"
        return [launcher, "--num_gpus", str(gpus), "--module", "tapetrain.train", config, *overrides]
    return [*tapetrain().split(), "train", config, *overrides]


def table(reports: dict[str, dict], scale: str) -> str:
    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.2f}"

    paper_col = " | paper (whole 2x grid)" if scale == "paper" else ""
    lines = [f"| PE | in distribution | out of distribution | whole grid{paper_col} |",
             "|---|---|---|---|" + ("---|" if paper_col else "")]
    for pe, r in reports.items():
        row = (f"| {NAMES[pe]} | {pct(r['mean_in_distribution'])} | {pct(r['mean_out_of_distribution'])} | "
               f"{pct(r['mean_all'])} |")
        lines.append(row + (f" {PAPER[pe]:.2f} |" if paper_col else ""))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), required=True)
    parser.add_argument("--out", default=None, help="output directory (default arith-compare-SCALE)")
    parser.add_argument("--pes", default=",".join(PES), help=f"comma-separated subset of {','.join(PES)}")
    parser.add_argument("--gpus", type=int, default=0, help="train under `deepspeed --num_gpus N` (0 = one process)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every run, e.g. train.steps=2000 (repeatable)")
    parser.add_argument("--data-args", default=None, help="replace the scale's `data arith` arguments (one string)")
    args = parser.parse_args()
    pes = [p for p in args.pes.split(",") if p]
    unknown = sorted(set(pes) - set(PES))
    if unknown:
        parser.error(f"unknown PE(s) {unknown}; choose from {', '.join(PES)}")
    scale = SCALES[args.scale]
    out = (REPO / (args.out or f"arith-compare-{args.scale}")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    previous = out / "summary.json"  # a resumed comparison keeps the timings of the steps it skips
    timings: dict[str, float] = json.loads(previous.read_text())["seconds"] if previous.exists() else {}
    data_args = args.data_args.split() if args.data_args else scale["data"]
    if not (data / "manifest.json").exists():
        run("data arith", [*tapetrain().split(), "data", "arith", "--out", str(data), *data_args], timings)
    reports = {}
    for pe in pes:
        run_dir = out / "runs" / pe
        config = scale["config"].format(pe=pe)
        overrides = [f"run.out_dir={run_dir}", f"data.train={data}", f"model.pe={pe}", *args.set]
        if not (run_dir / "DONE.json").exists():
            run(f"train {pe}", train_cmd(config, args.gpus, overrides), timings)
        result = out / f"{pe}.json"
        if not result.exists():
            run(f"eval {pe}", [*tapetrain().split(), "eval", "arith", str(run_dir), "--data", str(data), "--out",
                               str(result), "--plot", str(out / f"{pe}.png")], timings)
        reports[pe] = json.loads(result.read_text())
    from tapetrain.eval.arith_plots import plot_heatmaps

    plot_heatmaps(list(reports.values()), str(out / "heatmaps.png"), labels=[NAMES[p] for p in reports])
    text = table(reports, args.scale)
    summary = {"scale": args.scale, "data_args": data_args, "overrides": args.set, "gpus": args.gpus,
               "seconds": timings,
               "results": {pe: {k: r[k] for k in ("mean_in_distribution", "mean_out_of_distribution", "mean_all")}
                           for pe, r in reports.items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(text + "\n")
    print(text)
    print(f"[arith-compare] wrote {out / 'summary.md'}, {out / 'summary.json'} and {out / 'heatmaps.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
