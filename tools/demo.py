"""The embedded default job (`make demo`): train, compare and report TAPE vs RoPE end to end.

Every step is a public command, run the way a user would run it:

  1. corpus     Python's standard-library sources -> demo-work/corpus.jsonl (text on every machine with Python)
  2. tokenizer  tapetrain data tokenizer (sentencepiece BPE, vocab 512)
  3. prepare    tapetrain data prepare (token shards + manifest, 5% validation split)
  4. train      deepspeed --num_gpus 2 --module tapetrain.train configs/demo-{tape,rope}.yaml (ZeRO-2)
  5. export     tapetrain export hf (verified against tapetrain's logits)
  6. evaluate   tapetrain eval ppl on the validation split at 1x, 2x and 4x the training length
  7. report     demo-report/README.md, loss curves and PPL-vs-length plots

A step whose output already exists is skipped, so re-running only does what is missing
(`make clean-demo` starts over).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "demo-work"
REPORT = REPO / "demo-report"
BIN = Path(sys.executable).parent
PES = ("tape", "rope")
SEQ_LEN = 128
EVAL_LENGTHS = (SEQ_LEN, 2 * SEQ_LEN, 4 * SEQ_LEN)


def tool(name: str) -> str:
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if not found:
        raise SystemExit(f"demo: `{name}` is not installed in {BIN}; run `make setup` first")
    return found


def step(title: str, done: Path, cmd: list[str], timings: dict, env: dict | None = None) -> None:
    """Run `cmd` unless `done` exists; print the command so the demo doubles as a tutorial."""
    if done.exists():
        print(f"[demo] {title}: already done ({done.relative_to(REPO)})", flush=True)
        return
    print(f"[demo] {title}:\n    $ {' '.join(str(c) for c in cmd)}", flush=True)
    start = time.perf_counter()
    run_env = {**os.environ, **(env or {})}
    result = subprocess.run([str(c) for c in cmd], cwd=REPO, env=run_env)
    if result.returncode != 0:
        raise SystemExit(f"demo: step '{title}' failed (exit {result.returncode}); fix the error above and re-run")
    timings[title] = time.perf_counter() - start


def build_corpus(path: Path, max_files: int) -> None:
    """One JSON line per stdlib module (sorted, so every machine with the same Python builds the same corpus)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 2000)[:max_files]
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for file in files:
            f.write(json.dumps({"text": file.read_text(encoding="utf-8", errors="replace"), "file": file.name}) + "\n")
    os.replace(tmp, path)
    print(f"[demo] corpus: {len(files)} files from {stdlib} -> {path.relative_to(REPO)}", flush=True)


def launcher_command(pe: str, ranks: int, cuda: bool) -> list[str]:
    cmd = [tool("deepspeed"), "--num_gpus", str(ranks), "--master_port", str(29500 + os.getpid() % 1000)]
    cmd += ["--module", "tapetrain.train", f"configs/demo-{pe}.yaml"]
    if cuda:
        cmd.append("deepspeed.precision=bf16")
    return cmd


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def plot_losses(curves: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for pe, records in curves.items():
        train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        line = ax.plot(*zip(*train, strict=True), label=f"{pe} train", alpha=0.8)[0]
        if val:
            ax.plot(*zip(*val, strict=True), "o--", color=line.get_color(), label=f"{pe} validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Tiny decoder on Python stdlib source: TAPE vs RoPE")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def write_report(timings: dict, ranks: int, device: str) -> Path:
    curves = {pe: read_metrics(WORK / "runs" / pe) for pe in PES}
    ppl = {pe: json.loads((REPORT / f"ppl-{pe}.json").read_text()) for pe in PES}
    plot_losses(curves, REPORT / "loss.png")
    from tapetrain.eval.report import plot_ppl

    plot_ppl([ppl[pe] for pe in PES], REPORT / "ppl_vs_length.png")
    manifest = json.loads((WORK / "data" / "manifest.json").read_text())

    lines = [
        "# tapetrain demo: TAPE vs RoPE",
        "",
        f"Tiny decoder (preset `tiny`: 2 layers, d_model 64, 4 heads / 2 KV heads) trained for "
        f"{curves['tape'][-1]['step']} steps at {SEQ_LEN} tokens on {ranks} rank(s) ({device}), DeepSpeed ZeRO-2, "
        f"on Python's standard-library source ({manifest['num_documents']} files, {manifest['num_tokens']:,} tokens, "
        "sentencepiece BPE vocab 512). Both runs share every setting but the positional encoding.",
        "",
        "## Training",
        "",
        "| PE | final train loss | final val loss | val PPL | tokens/s (last log) |",
        "|---|---|---|---|---|",
    ]
    for pe in PES:
        train = [r for r in curves[pe] if r.get("loss") is not None]
        val = [r for r in curves[pe] if "val_loss" in r]
        last_val = val[-1] if val else {}
        lines.append(
            f"| {pe} | {train[-1]['loss']:.4f} | {last_val.get('val_loss', float('nan')):.4f} | "
            f"{last_val.get('val_ppl', float('nan')):.2f} | {train[-1]['tokens_per_s']:.0f} |"
        )
    lines += ["", "![loss curves](loss.png)", "", "## Perplexity vs evaluation length (validation split)", ""]
    lines += ["Exported Hugging Face checkpoints, non-overlapping windows; "
              f"{SEQ_LEN} is the training length, longer windows test extrapolation.", ""]
    lengths = [r["length"] for r in ppl["tape"]["results"]]
    lines.append("| PE | " + " | ".join(str(n) for n in lengths) + " |")
    lines.append("|---|" + "---|" * len(lengths))
    for pe in PES:
        lines.append(f"| {pe} | " + " | ".join(f"{r['ppl']:.2f}" for r in ppl[pe]["results"]) + " |")
    lines += ["", "![perplexity vs length](ppl_vs_length.png)", "", "## Wall time of this invocation", ""]
    lines += [f"- {title}: {seconds:.0f} s" for title, seconds in timings.items()] or ["- everything was reused"]
    lines += ["", "Reproduce: `make demo` (re-running reuses finished steps; `make clean-demo` starts over)."]
    summary = {
        pe: {
            "final_train_loss": [r for r in curves[pe] if r.get("loss") is not None][-1]["loss"],
            "val": [r for r in curves[pe] if "val_loss" in r][-1:] or None,
            "ppl": ppl[pe]["results"],
        }
        for pe in PES
    }
    (REPORT / "summary.json").write_text(json.dumps({"timings_s": timings, **summary}, indent=2))
    out = REPORT / "README.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks for training (default 2)")
    parser.add_argument("--max-files", type=int, default=160, help="stdlib modules in the corpus")
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    ranks = min(args.ranks, torch.cuda.device_count()) if cuda else args.ranks
    device = torch.cuda.get_device_name(0) if cuda else f"CPU, {os.cpu_count()} cores"
    started = time.perf_counter()
    timings: dict[str, float] = {}
    WORK.mkdir(exist_ok=True)
    REPORT.mkdir(exist_ok=True)
    tapetrain = tool("tapetrain")

    corpus = WORK / "corpus.jsonl"
    if not corpus.exists():
        build_corpus(corpus, args.max_files)
    step("tokenizer", WORK / "tok.model",
         [tapetrain, "data", "tokenizer", "--input", corpus, "--vocab-size", "512", "--out", WORK / "tok.model"],
         timings)
    step("prepare", WORK / "data" / "manifest.json",
         [tapetrain, "data", "prepare", "--input", corpus, "--tokenizer", WORK / "tok.model", "--out", WORK / "data",
          "--val-fraction", "0.05", "--workers", "2"], timings)
    threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // ranks))}
    for pe in PES:
        step(f"train {pe}", WORK / "runs" / pe / "DONE.json", launcher_command(pe, ranks, cuda), timings, threads)
    for pe in PES:
        step(f"export {pe}", WORK / "hf" / pe / "config.json",
             [tapetrain, "export", "hf", WORK / "runs" / pe, "--out", WORK / "hf" / pe], timings)
    lengths = ",".join(str(n) for n in EVAL_LENGTHS)
    for pe in PES:
        step(f"eval ppl {pe}", REPORT / f"ppl-{pe}.json",
             [tapetrain, "eval", "ppl", WORK / "hf" / pe, "--data", WORK / "data", "--lengths", lengths,
              "--out", REPORT / f"ppl-{pe}.json"], timings)
    report = write_report(timings, ranks, device)
    print(f"[demo] done in {time.perf_counter() - started:.0f} s; report: {report.relative_to(REPO)}", flush=True)
    print(report.read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
