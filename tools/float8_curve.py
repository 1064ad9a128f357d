#!/usr/bin/env python
"""Loss curves of the same run in high precision and with train.float8: does FP8 train as well?

Builds a corpus of Python's standard-library sources (present on every machine, no internet), a sentencepiece
tokenizer and token shards with the tapetrain CLI, then trains one model twice with `tapetrain train`, every setting
equal but train.float8 (off, then the recipe), and writes OUT/float8-curve.json: both curves, the final loss of
each (the mean of the last 10% of steps) and their relative difference against the target (torchao reports its
recipes within 1% of bf16's loss).

    python tools/float8_curve.py --out DIR [--preset paper-155m] [--steps 300] [--recipe rowwise] [--set KEY=VALUE]

On a CPU it runs only with TAPETRAIN_FLOAT8_EMULATE=1 (torchao's emulation, for trying the tool; tests only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import yaml

from tapetrain.atomic_io import write_json, write_text

TARGET = 0.01  # float8's final loss within 1% of the high-precision run's


def final_loss(curve: dict[int, float]) -> float:
    """The mean loss of the last 10% of steps (at least one): one step's loss is too noisy to compare."""
    steps = sorted(curve)
    last = steps[-max(1, len(steps) // 10):]
    return sum(curve[s] for s in last) / len(last)


def compare_curves(reference: dict[int, float], float8: dict[int, float]) -> dict:
    if sorted(reference) != sorted(float8) or not reference:
        raise ValueError(f"the runs logged different steps: {sorted(reference)[-3:]} vs {sorted(float8)[-3:]}")
    ref, f8 = final_loss(reference), final_loss(float8)
    relative = (f8 - ref) / ref
    return {"final_loss_reference": ref, "final_loss_float8": f8, "relative_difference": relative,
            "target": TARGET, "within_target": abs(relative) <= TARGET}


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def cli(*args: object) -> None:
    subprocess.run([sys.executable, "-m", "tapetrain.cli", *map(str, args)], check=True)


def prepare_data(work: Path, vocab: int) -> Path:
    """Standard-library sources -> tokenizer (vocab `vocab`) -> token shards with a 2% validation split."""
    data = work / "data"
    if (data / "manifest.json").is_file():
        return data
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = [json.dumps({"text": p.read_text(encoding="utf-8", errors="replace")}) for p in sorted(stdlib.glob("*.py"))]
    write_text(work / "corpus.jsonl", "\n".join(lines) + "\n")
    cli("data", "tokenizer", "--input", work / "corpus.jsonl", "--vocab-size", vocab, "--out", work / "tok.model")
    cli("data", "prepare", "--input", work / "corpus.jsonl", "--tokenizer", work / "tok.model", "--out", data,
        "--val-fraction", "0.02", "--workers", "4")
    return data


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--preset", default="paper-155m")
    p.add_argument("--recipe", default="rowwise", choices=["rowwise", "tensorwise"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="sequences per step (one rank)")
    p.add_argument("--vocab", type=int, default=8192, help="the tokenizer's vocabulary (model.vocab_size)")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for both runs, e.g. --set model.compile=false (repeatable)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args.out, args.vocab)
    curves = {}
    for setting in ("off", args.recipe):
        run_dir = args.out / f"run-{setting}"
        config = {
            "run": {"out_dir": str(run_dir), "seed": 0},
            "model": {"preset": args.preset, "pe": "tape", "vocab_size": args.vocab, "max_seq_len": args.seq_len,
                      "compile": True},
            "data": {"train": str(data), "seq_len": args.seq_len},
            "train": {"steps": args.steps, "micro_batch_size": args.batch, "global_batch_size": args.batch,
                      "save_interval": 0, "log_interval": 1, "float8": setting, "resume": "none"},
            "optim": {"lr": 6e-4, "warmup_steps": max(1, args.steps // 20), "schedule": "cosine"},
            "deepspeed": {"zero_stage": 2, "precision": args.precision},
            "logging": {"tensorboard": False},
        }
        config_path = args.out / f"float8-{setting}.yaml"
        write_text(config_path, yaml.safe_dump(config))
        subprocess.run([sys.executable, "-m", "tapetrain.train", str(config_path), *args.overrides], check=True)
        curves[setting] = losses(run_dir)
    result = {"preset": args.preset, "recipe": args.recipe, "steps": args.steps, "seq_len": args.seq_len,
              "batch": args.batch, "precision": args.precision,
              **compare_curves(curves["off"], curves[args.recipe]),
              "curves": {k: [v[s] for s in sorted(v)] for k, v in curves.items()}}
    write_json(args.out / "float8-curve.json", result, indent=1)
    print(f"float8 {args.recipe} final loss {result['final_loss_float8']:.4f} vs {result['final_loss_reference']:.4f} "
          f"high precision: {100 * result['relative_difference']:+.2f}% (target within ±{100 * TARGET:.0f}%)")
    return 0 if result["within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
