#!/usr/bin/env python
"""Train and evaluate TAPE and its four arithmetic baselines (RoPE, RandPE, NoPE, FIRE) on addition, like for like,
on several seeds.

    python tools/arith_compare.py --scale tiny  [--seeds 3] [--out arith-compare-tiny]   # 2 CPU cores
    python tools/arith_compare.py --scale paper --gpus 8 [--out arith-compare]            # the paper's recipe
    python tools/arith_compare.py --scale paper --gpus 1 --pes tape,rope --set train.steps=2000   # a GPU-hour budget

Every PE is trained and evaluated on the same N seed pairs: pair i = (data seed D + i for `tapetrain data arith
--seed`, model seed M + i for run.seed), D = --data-seed (42), M = --model-seed (0), so pair 0 is the single-seed
run of earlier versions. Every step is a public command (`tapetrain data arith`, `tapetrain train` with only
model.pe, run.seed, run.out_dir and data.train changed, `tapetrain eval arith`). Writes OUT/results/PE/seed-M.json
(the per-seed results), OUT/summary.json and OUT/summary.md (per PE: mean ± sd and min–max over seeds in
distribution, out of distribution and on the whole grid; which differences the seeds resolve: disjoint per-seed
ranges) and OUT/heatmaps.png (mean heatmaps, per-cell sd, per-seed dots). Finished runs and evaluations are reused:
a rerun trains nothing already done, and an interrupted training run resumes from its last checkpoint.
The logic lives in tapetrain.eval.arith_sweep and tapetrain.eval.arith_seeds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tapetrain.errors import UserError
from tapetrain.eval.arith_sweep import PE_OVERRIDES, PES, SCALES, Sweep, run_sweep, seed_pairs

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), required=True)
    parser.add_argument("--out", default=None, help="output directory (default arith-compare-SCALE)")
    parser.add_argument("--pes", default=",".join(PES), help=f"comma-separated subset of {','.join(PES)}")
    parser.add_argument("--seeds", type=int, default=3, help="seed pairs per PE (default 3)")
    parser.add_argument("--data-seed", type=int, default=42, help="data seed of pair 0 (pair i: + i)")
    parser.add_argument("--model-seed", type=int, default=0, help="run.seed of pair 0 (pair i: + i)")
    parser.add_argument("--gpus", type=int, default=0, help="train under `deepspeed --num_gpus N` (0 = one process)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override for every run, e.g. train.steps=2000 (repeatable)",
    )
    parser.add_argument("--data-args", default=None, help="replace the scale's `data arith` arguments (one string)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pes = [p for p in args.pes.split(",") if p]
    unknown = sorted(set(pes) - set(PES))
    if unknown:
        raise SystemExit(f"arith_compare: unknown PE(s) {unknown}; choose from {', '.join(PES)}")
    scale = SCALES[args.scale]
    sweep = Sweep(
        out=(REPO / (args.out or f"arith-compare-{args.scale}")).resolve(),
        pes=pes,
        pairs=seed_pairs(args.seeds, args.data_seed, args.model_seed),
        config=scale["config"],
        data_args=args.data_args.split() if args.data_args else scale["data"],
        overrides=args.set,
        pe_overrides=PE_OVERRIDES.get(args.scale, {}),
        gpus=args.gpus,
        cwd=REPO,
        paper=args.scale == "paper",
    )
    try:
        summary = run_sweep(sweep)
    except UserError as err:
        raise SystemExit(f"arith_compare: {err}") from None
    print((sweep.out / "summary.md").read_text(), end="")
    reused = "nothing" if not summary["steps_run"] else ", ".join(summary["steps_run"])
    print(f"[arith-compare] ran: {reused}; wrote {sweep.out / 'summary.md'}, summary.json and heatmaps.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
