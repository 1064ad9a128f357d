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
    assert str(data / "tokenizer.model") in config  # data.tokenizer filled in from the example store

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
