"""The embedded default job (`make demo`): train, compare and report TAPE vs RoPE end to end.

Every step is a public command, run the way a user would run it:

  1. corpus     Python's standard-library sources -> demo-work/corpus.jsonl (text on every machine with Python)
  2. tokenizer  tapetrain data tokenizer (sentencepiece BPE, vocab 512)
  3. prepare    tapetrain data prepare (token shards + manifest, 5% validation split)
  4. train      deepspeed --num_gpus 2 --module tapetrain.train configs/demo-{tape,rope}.yaml (ZeRO-2)
  5. export     tapetrain export hf (verified against tapetrain's logits)
  6. compare    tapetrain compare on both exports: perplexity on the validation split at 1x, 2x and 4x the
                training length and the needle grid at 2x and 4x (its prompt alone takes ~150 tokens of this
                tokenizer), with confidence intervals; it writes demo-report/ (README.md, summary.json, the
                training loss, PPL-vs-length and needle heatmap figures)

A step whose output already exists is skipped (compare reuses every result it already has), so re-running only
does what is missing (`make clean-demo` starts over).
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
NEEDLE_TRIALS = 10  # per (length, depth); compare's default depths 0, 0.25, 0.5, 0.75, 1
NEEDLE_LENGTHS = (2 * SEQ_LEN, 4 * SEQ_LEN)  # the passkey task, key line and question take ~150 of these tokens


def tool(name: str) -> str:
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if not found:
        raise SystemExit(f"demo: `{name}` is not installed in {BIN}; run `make setup` first")
    return found


def step(title: str, done: Path | None, cmd: list, timings: dict, env: dict | None = None) -> None:
    """Run `cmd` unless `done` exists (None: always); print the command so the demo doubles as a tutorial."""
    if done is not None and done.exists():
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


def write_notes(path: Path, timings: dict, ranks: int, device: str) -> None:
    """The report's introduction (what was trained, on what, how long each step took); compare writes the rest."""
    manifest = json.loads((WORK / "data" / "manifest.json").read_text())
    steps = [json.loads(line) for line in (WORK / "runs" / "tape" / "metrics.jsonl").read_text().splitlines() if line]
    last = [r for r in steps if r.get("loss") is not None][-1]["step"]
    lines = [
        f"Tiny decoder (preset `tiny`: 2 layers, d_model 64, 4 heads / 2 KV heads) trained for {last} steps at "
        f"{SEQ_LEN} tokens on {ranks} rank(s) ({device}), DeepSpeed ZeRO-2, on Python's standard-library source "
        f"({manifest['num_documents']} files, {manifest['num_tokens']:,} tokens, sentencepiece BPE vocab 512). Both "
        "runs share every setting but the positional encoding; the exported Hugging Face checkpoints are evaluated "
        f"on the held-out validation split. {SEQ_LEN} is the training length, longer contexts test extrapolation; the "
        "needle grid starts at 256 tokens, since its task, key line and question alone take ~150 tokens of this "
        "tokenizer.",
        "",
        "Wall time of this invocation of `make demo`: "
        + ("; ".join(f"{title} {seconds:.0f} s" for title, seconds in timings.items()) or "everything was reused")
        + ". Re-running reuses finished steps and results; `make clean-demo` starts over.",
    ]
    path.write_text("\n".join(lines) + "\n")


def compare_command(tapetrain: str, notes: Path) -> list:
    """Paths relative to the repository (the step runs there), so that the report names no machine's paths."""
    work, report = WORK.relative_to(REPO), REPORT.relative_to(REPO)
    lengths = ",".join(str(n) for n in EVAL_LENGTHS)
    needle = ",".join(str(n) for n in NEEDLE_LENGTHS)
    return [tapetrain, "compare", work / "hf" / "tape", work / "hf" / "rope", "--labels", "TAPE", "RoPE",
            "--suite", "ppl,needle", "--data", work / "data", "--lengths", lengths, "--needle-lengths", needle,
            "--trials", str(NEEDLE_TRIALS), "--batch-size", "8",
            "--title", "tapetrain demo: TAPE vs RoPE", "--notes", notes.relative_to(REPO), "--out", report]


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
    notes = WORK / "report-notes.md"
    write_notes(notes, timings, ranks, device)
    step("compare", None, compare_command(tapetrain, notes), timings)  # compare itself reuses what it already has
    report = REPORT / "README.md"
    print(f"[demo] done in {time.perf_counter() - started:.0f} s; report: {report.relative_to(REPO)}", flush=True)
    print(report.read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
