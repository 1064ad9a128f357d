"""The addition comparison of `tools/arith_compare.py`: every PE trained and evaluated on the same seed pairs.

Seed pair i (i = 0 .. N-1) is (data seed = data_base + i, model seed = model_base + i); with the defaults (42, 0)
pair 0 is the committed single-seed table's run. Layout under OUT (finished steps are reused, so a rerun trains
and evaluates nothing already done):

    OUT/seed_pairs.json                    the pairs; a rerun with other pairs in the same OUT is refused
    OUT/data/seed-D/                       `tapetrain data arith --seed D`
    OUT/runs/PE/seed-M/                    `tapetrain train` with run.seed=M (DONE.json = finished)
    OUT/results/PE/seed-M.json             `tapetrain eval arith` of that run: the per-seed results
    OUT/logs/...                           each command's output
    OUT/summary.json, summary.md, heatmaps.png

Every step is a public command run in a child process (DeepSpeed keeps process-wide state, so one process trains
once); one progress bar per (PE, seed) follows the run's metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tapetrain.errors import InputError
from tapetrain.eval.arith_seeds import (
    markdown_table,
    markdown_verdicts,
    pairwise,
    plot_loss_curves,
    plot_seed_summary,
    spreads,
    summary_dict,
)
from tapetrain.progress import progress

PES = ("tape", "rope", "randpe", "nope", "fire")
NAMES = {"tape": "TAPE", "rope": "RoPE", "randpe": "RandPE", "nope": "NoPE", "fire": "FIRE"}
# The paper's averages over the whole 2x heatmap (single-seed results; %), shown beside --scale paper tables.
PAPER = {"tape": 32.82, "fire": 26.98, "randpe": 26.56, "rope": 26.32, "nope": 22.45}
SCALES = {
    # operands up to 3 digits, grid to 6; the tiny recipe trains in minutes on 2 CPU cores
    "tiny": {
        "data": ["--max-digits", "3", "--eval-max-digits", "6", "--train-examples", "200000"],
        "config": "configs/arith-tiny-cpu.yaml",
    },
    # the tiny data with Abacus digit places: a length-generalisation signal at CPU scale
    "tiny-abacus": {
        "data": ["--max-digits", "3", "--eval-max-digits", "6", "--train-examples", "200000"],
        "config": "configs/arith-tiny-abacus-cpu.yaml",
    },
    # the paper: operands up to 20 digits, grid to 40 (defaults of `tapetrain data arith`)
    "paper": {"data": [], "config": "configs/arith-{pe}.yaml"},
}
# Per-PE settings of a scale's runs beyond model.pe (the paper's configs carry theirs in configs/arith-{pe}.yaml):
# the paper ran RandPE and NoPE without Abacus.
PE_OVERRIDES: dict[str, dict[str, list[str]]] = {
    "tiny-abacus": {"randpe": ["model.abacus=false"], "nope": ["model.abacus=false"]},
}
POLL_S = 1.0


@dataclass(frozen=True)
class SeedPair:
    data_seed: int
    model_seed: int


def seed_pairs(n: int, data_base: int = 42, model_base: int = 0) -> list[SeedPair]:
    """Pair i = (data_base + i, model_base + i): data and model seed move together, so N pairs need N runs per PE."""
    if n < 1:
        raise InputError(f"--seeds must be >= 1, got {n}")
    return [SeedPair(data_base + i, model_base + i) for i in range(n)]


@dataclass
class Sweep:
    """What to run: PEs x seed pairs, with one config per PE and shared extra overrides."""

    out: Path
    pes: list[str]
    pairs: list[SeedPair]
    config: str  # may contain {pe}
    data_args: list[str]
    overrides: list[str] = field(default_factory=list)
    gpus: int = 0
    pe_overrides: dict[str, list[str]] = field(default_factory=dict)  # PE -> its own KEY=VALUE (before --set)
    cwd: Path = Path(".")
    paper: bool = False  # add the paper's column to the table
    done: list[str] = field(default_factory=list)  # steps run by this invocation (the rest were reused)

    def data_dir(self, pair: SeedPair) -> Path:
        return self.out / "data" / f"seed-{pair.data_seed}"

    def run_dir(self, pe: str, pair: SeedPair) -> Path:
        return self.out / "runs" / pe / f"seed-{pair.model_seed}"

    def result(self, pe: str, pair: SeedPair) -> Path:
        return self.out / "results" / pe / f"seed-{pair.model_seed}.json"

    def log(self, name: str) -> Path:
        return self.out / "logs" / f"{name}.log"


def cli() -> list[str]:
    found = shutil.which("tapetrain", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "tapetrain.cli"]


def check_pairs(sweep: Sweep) -> None:
    """Write OUT/seed_pairs.json, or refuse when it records other data seeds for the same run directories."""
    path = sweep.out / "seed_pairs.json"
    mine = {str(p.model_seed): p.data_seed for p in sweep.pairs}
    known = json.loads(path.read_text()) if path.exists() else {}
    clash = [m for m, d in mine.items() if m in known and known[m] != d]
    if clash:
        raise InputError(
            f"{sweep.out} holds runs with model seed {clash[0]} on data seed {known[clash[0]]}, not "
            f"{mine[clash[0]]}; use another --out or the same --data-seed"
        )
    path.write_text(json.dumps({**known, **mine}, indent=2) + "\n")


def start(sweep: Sweep, name: str, cmd: list[str]) -> subprocess.Popen:
    log = sweep.log(name)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        return subprocess.Popen(
            cmd, cwd=sweep.cwd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )


def finish(sweep: Sweep, name: str, proc: subprocess.Popen) -> None:
    if proc.wait() != 0:
        tail = "".join(sweep.log(name).read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise InputError(
            f"arith compare: '{name}' failed (exit {proc.returncode}); its log {sweep.log(name)} ends:\n"
            f"{tail}\nfix the error and re-run (finished steps are reused)"
        )
    sweep.done.append(name)


def last_step(metrics: Path) -> int:
    """The newest logged step of a run (0 before the first log line)."""
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line).get("step", 0))
        except (ValueError, AttributeError):
            continue  # a line being written
    return 0


def train_cmd(sweep: Sweep, pe: str, pair: SeedPair) -> list[str]:
    overrides = [
        f"run.out_dir={sweep.run_dir(pe, pair)}",
        f"run.seed={pair.model_seed}",
        f"data.train={sweep.data_dir(pair)}",
        f"model.pe={pe}",
        *sweep.pe_overrides.get(pe, []),
        *sweep.overrides,
    ]
    config = sweep.config.format(pe=pe)
    if sweep.gpus > 0:
        launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
        return [launcher, "--num_gpus", str(sweep.gpus), "--module", "tapetrain.train", config, *overrides]
    return [*cli(), "train", config, *overrides]


def train_steps(sweep: Sweep, pe: str) -> int:
    from tapetrain.config import load_run_config

    overrides = [*sweep.pe_overrides.get(pe, []), *sweep.overrides]
    return load_run_config(str(sweep.cwd / sweep.config.format(pe=pe)), overrides).train.steps


def run_one(sweep: Sweep, pe: str, pair: SeedPair) -> dict:
    """Train (unless DONE.json) and evaluate (unless the result exists) one PE on one seed pair, with a bar."""
    run_dir, result = sweep.run_dir(pe, pair), sweep.result(pe, pair)
    name = f"{pe}-seed-{pair.model_seed}"
    steps = train_steps(sweep, pe)
    with progress(total=steps, desc=f"{NAMES.get(pe, pe)} seed {pair.model_seed}", unit="step") as bar:
        if not (run_dir / "DONE.json").exists():
            bar.set_postfix_str(f"train (data seed {pair.data_seed})")
            proc = start(sweep, f"train-{name}", train_cmd(sweep, pe, pair))
            while proc.poll() is None:
                time.sleep(POLL_S)
                bar.update(last_step(run_dir / "metrics.jsonl") - bar.n)
            finish(sweep, f"train-{name}", proc)
        bar.update(steps - bar.n)
        if not result.exists():
            bar.set_postfix_str("eval")
            result.parent.mkdir(parents=True, exist_ok=True)
            cmd = [*cli(), "eval", "arith", str(run_dir), "--data", str(sweep.data_dir(pair)), "--out", str(result)]
            finish(sweep, f"eval-{name}", start(sweep, f"eval-{name}", cmd))
        report = json.loads(result.read_text())
        bar.set_postfix_str(f"in distribution {100 * report['mean_in_distribution']:.1f}%")
    return report


def make_data(sweep: Sweep, pair: SeedPair) -> None:
    data = sweep.data_dir(pair)
    if not (data / "manifest.json").exists():
        name = f"data-seed-{pair.data_seed}"
        cmd = [*cli(), "data", "arith", "--out", str(data), "--seed", str(pair.data_seed), *sweep.data_args]
        finish(sweep, name, start(sweep, name, cmd))


def run_sweep(sweep: Sweep) -> dict:
    """Data, training and evaluation of every (PE, seed pair), then OUT/summary.{json,md} and OUT/heatmaps.png."""
    sweep.out.mkdir(parents=True, exist_ok=True)
    check_pairs(sweep)
    for pair in sweep.pairs:
        make_data(sweep, pair)
    reports = {pe: [run_one(sweep, pe, pair) for pair in sweep.pairs] for pe in sweep.pes}
    return write_summary(sweep, reports)


def write_summary(sweep: Sweep, reports: dict[str, list[dict]]) -> dict:
    """summary.json (per PE and metric: mean, sd, min, max, per-seed values; pairwise verdicts), summary.md, PNG."""
    table = spreads(reports)
    rows = pairwise(table)
    pairs = [{"data_seed": p.data_seed, "model_seed": p.model_seed} for p in sweep.pairs]
    summary = {
        **summary_dict(table, rows, pairs),
        "pes": sweep.pes,
        "config": sweep.config,
        "data_args": sweep.data_args,
        "overrides": sweep.overrides,
        "pe_overrides": sweep.pe_overrides,
        "gpus": sweep.gpus,
        "steps_run": list(sweep.done),
    }
    pair_list = ", ".join(f"({p.data_seed}, {p.model_seed})" for p in sweep.pairs)
    text = "\n\n".join(
        [
            markdown_table(table, NAMES, PAPER if sweep.paper else None),
            markdown_verdicts(rows, NAMES, len(sweep.pairs)),
            f"Seed pairs (data seed, model seed): {pair_list}\n",
        ]
    )
    (sweep.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (sweep.out / "summary.md").write_text(text)
    plot_seed_summary(reports, str(sweep.out / "heatmaps.png"), NAMES)
    curves = loss_curves(sweep)
    if any(curves.values()):
        (sweep.out / "loss_curves.json").write_text(json.dumps(curves) + "\n")
        plot_loss_curves(curves, str(sweep.out / "loss_curves.png"), NAMES)
    return summary


def loss_curves(sweep: Sweep) -> dict[str, dict[str, list[list[float]]]]:
    """{pe: {"seed-M": [[step, training loss], ...]}} from each run's metrics.jsonl (runs not on disk are left out):
    where a seed stalled, and for how long, is what the accuracy table alone does not show."""
    curves: dict[str, dict[str, list[list[float]]]] = {}
    for pe in sweep.pes:
        curves[pe] = {}
        for pair in sweep.pairs:
            metrics = sweep.run_dir(pe, pair) / "metrics.jsonl"
            if not metrics.exists():
                continue
            points = []
            for line in metrics.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line being written
                if "loss" in row and "step" in row:
                    points.append([int(row["step"]), float(row["loss"])])
            curves[pe][f"seed-{pair.model_seed}"] = points
    return curves
