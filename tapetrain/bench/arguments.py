"""The option blocks the benchmark modes share (each mode's `add_arguments` builds its parser from them).

Every mode starts with `add_report_args` (its --out, and what else of the report and run options it has), so the
same option means the same thing in every mode (tests/unit/test_benchmark_tool.py checks that each has the group).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tapetrain.bench.common import DTYPES
from tapetrain.bench.pairs import MIN_HEADLINE_PAIRS

REPORT_GROUP = "report and run"  # the argument group `add_report_args` creates in every mode


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_report_args(p: argparse.ArgumentParser, *, plot: bool = True, device: bool = True, run: bool = True) -> None:
    """--out, and optionally the figure's (--plot, --no-plot), the device's (--device) and the run's options
    (--dtype, --seed, --threads, --no-progress). Modes leave out what they do not have: engine and sp use the
    device their runtime picks, data writes no figure and times no model."""
    g = p.add_argument_group(REPORT_GROUP)
    g.add_argument("--out", type=Path, help="write the results as JSON here (atomically)")
    if plot:
        g.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
        g.add_argument("--no-plot", action="store_true", help="do not write a PNG")
    if device:
        g.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda[:N]")
    if run:
        g.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--threads", type=int, help="CPU: torch intra-op threads (1 is steadier on a shared machine)")
        g.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")


CPU_OR_CUDA = "2 on CPU, 8 on CUDA"  # the batch of the modes whose defaults depend on the device
PRESET_LENGTH = "the preset's max_seq_len, ≤128 on CPU"


def add_model_args(p: argparse.ArgumentParser, *, seq_len: int | str, batch: int | str) -> None:
    """The model a mode builds: --preset, --seq-len, --batch, --backend, --set. `seq_len`, `batch`: the default,
    or (a string) how the mode picks it."""
    p.add_argument("--preset", default="tiny", help="model preset: tiny, paper-155m, llama-1b, llama2-7b, ...")
    for flag, default, what in (("--seq-len", seq_len, "tokens per sequence"),
                                ("--batch", batch, "sequences per step")):
        fixed = isinstance(default, int)
        p.add_argument(flag, type=int, default=default if fixed else None,
                       help=f"{what} (default{' ' if fixed else ': '}{default})")
    p.add_argument("--backend", default="auto", help="model.attn_backend: auto, eager, sdpa, triton, flash, fa4, ...")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config key, e.g. --set n_layers=4 (repeatable)")


def add_steps_args(p: argparse.ArgumentParser) -> None:
    """Timed optimizer steps and MFU (train, engine)."""
    p.add_argument("--steps", type=int, help="timed rounds, each variant once, order rotated (≥ 10 for a headline)")
    p.add_argument("--warmup", type=int, help="untimed optimizer steps first")
    p.add_argument("--peak-tflops", type=float, help="device peak TFLOP/s for MFU (needed on CPU/unknown GPUs)")


def add_rounds_args(p: argparse.ArgumentParser, pairs_help: str) -> None:
    """--pairs, --warmup and --allow-few-pairs of the modes that alternate their variants round by round."""
    p.add_argument("--pairs", type=int, default=MIN_HEADLINE_PAIRS,
                   help=f"{pairs_help} (default and minimum {MIN_HEADLINE_PAIRS})")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--allow-few-pairs", action="store_true",
                   help=f"allow fewer than {MIN_HEADLINE_PAIRS} pairs (tests); the JSON is then no headline")
