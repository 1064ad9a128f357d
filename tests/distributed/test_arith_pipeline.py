"""Addition end to end through the public commands, as a fresh clone runs it: `tapetrain data arith` -> `tapetrain
train configs/arith-tiny-cpu.yaml data.train=DIR` (shortened) -> `tapetrain eval arith` on the run directory, on its
Hugging Face export (same cells) and on two ranks under torchrun (same cells)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO, env, run

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "tapetrain.cli"]


def test_arith_data_train_eval_export(tmp_path):
    data, run_dir = tmp_path / "arith", tmp_path / "run"
    run([*CLI, "data", "arith", "--out", str(data), "--max-digits", "3", "--eval-max-digits", "5",
         "--train-examples", "20000", "--eval-per-cell", "8"])
    run([*CLI, "train", str(REPO / "configs" / "arith-tiny-cpu.yaml"), f"data.train={data}",
         f"run.out_dir={run_dir}", "train.steps=300", "train.log_interval=10", "train.save_interval=300"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < 0.7 * losses[0]  # the answer-only loss falls: the path learns
    config = (run_dir / "config.yaml").read_text()
    # data.tokenizer filled in from the example store; the run keeps a copy and config.yaml names it
    assert f"tokenizer: {run_dir / 'tokenizer' / 'tokenizer.model'}" in config
    assert (run_dir / "tokenizer" / "tokenizer.model").read_bytes() == (data / "tokenizer.model").read_bytes()

    out = tmp_path / "run.json"
    run([*CLI, "eval", "arith", str(run_dir), "--data", str(data), "--out", str(out),
         "--plot", str(tmp_path / "h.png")])
    report = json.loads(out.read_text())
    assert len(report["cells"]) == 25 and sum(c["n"] for c in report["cells"]) == report["problems"]
    means = [report[k] for k in ("mean_in_distribution", "mean_out_of_distribution", "mean_all")]
    assert all(0.0 <= m <= 1.0 for m in means)
    assert report["mean_all"] == pytest.approx(sum(c["accuracy"] for c in report["cells"]) / 25)
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"

    hf = tmp_path / "hf"
    run([*CLI, "export", "hf", str(run_dir), "--out", str(hf)])
    assert (hf / "tokenizer.model").is_file()
    run([*CLI, "eval", "arith", str(hf), "--data", str(data), "--out", str(tmp_path / "hf.json")])
    assert json.loads((tmp_path / "hf.json").read_text())["cells"] == report["cells"]

    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "tapetrain.cli", "eval", "arith", str(run_dir),
           "--data", str(data), "--out", str(tmp_path / "two.json")]
    subprocess.run(cmd, check=True, env={**env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, cwd=REPO,
                   timeout=600, capture_output=True)
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2 and two["cells"] == report["cells"]


def test_eval_arith_errors_are_clear(tmp_path):
    data = tmp_path / "arith"
    run([*CLI, "data", "arith", "--out", str(data), "--max-digits", "2", "--eval-max-digits", "2",
         "--train-examples", "100", "--eval-per-cell", "2"])
    proc = subprocess.run([*CLI, "eval", "arith", str(tmp_path / "nope"), "--data", str(data), "--out",
                           str(tmp_path / "r.json")], cwd=REPO, env=env(), capture_output=True, text=True)
    assert proc.returncode == 1 and "does not exist" in proc.stderr
    proc = subprocess.run([*CLI, "eval", "arith", str(tmp_path), "--data", str(tmp_path), "--out",
                           str(tmp_path / "r.json")], cwd=REPO, env=env(), capture_output=True, text=True)
    assert proc.returncode == 1 and "data arith" in proc.stderr
    assert not os.path.exists(tmp_path / "r.json")


def test_arith_compare_over_seeds_reuses_finished_runs(tmp_path):
    """tools/arith_compare.py --seeds 2 on two PEs (a few steps each): each (PE, seed) pair trains in its own
    runs/PE/seed-M with run.seed=M on data seed 42 + M, the summary holds the per-seed results, `tapetrain compare`
    reads runs/PE as a group of seeds, and a second invocation trains and evaluates nothing."""
    from tapetrain.compare.entries import resolve_entries

    out = tmp_path / "cmp"
    short = ["--set", "train.steps=4", "--set", "train.log_interval=1", "--set", "optim.warmup_steps=1"]
    cmd = [sys.executable, str(REPO / "tools" / "arith_compare.py"), "--scale", "tiny", "--pes", "tape,nope",
           "--seeds", "2", "--out", str(out), *short,
           "--data-args", "--max-digits 2 --eval-max-digits 3 --train-examples 2000 --eval-per-cell 4"]
    first = run(cmd)
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary["steps_run"]) == sorted(
        ["data-seed-42", "data-seed-43"] + [f"{step}-{pe}-seed-{s}" for step in ("train", "eval")
                                            for pe in ("tape", "nope") for s in (0, 1)])
    for pe in ("tape", "nope"):
        for seed in (0, 1):
            run_dir = out / "runs" / pe / f"seed-{seed}"
            config = (run_dir / "config.yaml").read_text()
            assert f"seed: {seed}\n" in config and f"data/seed-{42 + seed}" in config
            report = json.loads((out / "results" / pe / f"seed-{seed}.json").read_text())
            assert summary["results"][pe]["mean_all"]["per_seed"][seed] == report["mean_all"]
    group = resolve_entries([str(out / "runs" / "tape")])[0]
    assert group.is_group and [r.seed for r in group.runs] == [0, 1]
    assert "TAPE" in first.stdout and "ranges (min–max) do not overlap" in first.stdout

    kept = [*out.glob("runs/*/*/DONE.json"), *out.glob("runs/*/*/metrics.jsonl"), *out.glob("results/*/*.json"),
            *out.glob("data/*/manifest.json")]
    assert len(kept) == 14
    stamps = {p: p.stat().st_mtime_ns for p in kept}
    second = run(cmd)
    assert json.loads((out / "summary.json").read_text())["steps_run"] == []
    assert "ran: nothing" in second.stdout
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_seed_overrides_train_in_seed_dirs_that_compare_groups(tmp_path):
    """`tapetrain train configs/arith-tiny-cpu.yaml run.seed=S` (no run.out_dir) from a fresh directory writes
    runs/arith-tiny-cpu/seed-S, one per seed, and `tapetrain compare` reads runs/arith-tiny-cpu as a seed group."""
    from tapetrain.compare.entries import resolve_entries

    data = tmp_path / "arith"
    run([*CLI, "data", "arith", "--out", str(data), "--max-digits", "2", "--eval-max-digits", "2",
         "--train-examples", "500", "--eval-per-cell", "2"])
    short = ["train.steps=3", "train.log_interval=1", "optim.warmup_steps=1"]
    for seed in (1, 2):
        cmd = [*CLI, "train", str(REPO / "configs" / "arith-tiny-cpu.yaml"), f"data.train={data}", f"run.seed={seed}",
               *short]
        proc = subprocess.run(cmd, cwd=tmp_path, env={**env(), "PYTHONPATH": str(REPO)}, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    group = tmp_path / "runs" / "arith-tiny-cpu"
    assert sorted(p.name for p in group.iterdir()) == ["seed-1", "seed-2"]
    for seed in (1, 2):
        done = json.loads((group / f"seed-{seed}" / "DONE.json").read_text())
        assert done["name"] == f"arith-tiny-cpu-seed-{seed}"
        assert f"seed: {seed}\n" in (group / f"seed-{seed}" / "config.yaml").read_text()
    entry = resolve_entries([str(group)])[0]
    assert entry.is_group and [r.seed for r in entry.runs] == [1, 2] and entry.label == "arith-tiny-cpu"
