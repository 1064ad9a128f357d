"""SCROLLS end to end through the public commands on local files in SCROLLS' record format, as a fresh clone runs
it: synthetic key-value records -> `tapetrain data scrolls` -> train -> fine-tune from that run directory
(model.init_from) -> `eval scrolls` on one rank and on two (same predictions). Kept short: the loss must fall far
below chance and the fine-tuning must continue from the trained weights; the full-length run that reaches high
exact match is a measured result in the README. Also init_from with a tapetrain run directory and export."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import REPO, env, run, write_config

from tapetrain.checkpoint.hf_export import export_hf
from tapetrain.checkpoint.init_source import copy_init_weights, init_model_config
from tapetrain.checkpoint.run_loader import load_run_model
from tapetrain.model import Transformer

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "tapetrain.cli"]
SEQ = ["--seq-len", "64", "--max-answer-tokens", "8"]
FIXTURES = REPO / "tests" / "fixtures" / "scrolls"


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_synthetic_scrolls_data_train_fine_tune_eval(tmp_path):
    kv, data = tmp_path / "kv", tmp_path / "kv-data"
    run([sys.executable, str(REPO / "tools" / "synthetic_scrolls.py"), "--out", str(kv), "--train", "2000",
         "--validation", "16"])
    run([*CLI, "data", "scrolls", "--task", "quality", "--input", str(kv / "train.jsonl"), "--tokenizer",
         str(kv / "tokenizer.model"), "--out", str(data), *SEQ])
    config = str(REPO / "configs" / "scrolls-synthetic-cpu.yaml")
    first, second = tmp_path / "pretrain", tmp_path / "finetune"
    run([*CLI, "train", config, f"run.out_dir={first}", f"data.train={data}", "train.steps=60",
         "train.save_interval=60", "train.log_interval=1", "optim.warmup_steps=5"])
    run([*CLI, "train", config, f"run.out_dir={second}", f"data.train={data}", f"model.init_from={first}",
         "run.seed=7", "train.steps=20", "train.save_interval=20", "train.log_interval=1", "optim.warmup_steps=1"])
    a, b = losses(first), losses(second)
    # 2 answer digits + EOS over a 46-token vocabulary: ln 46 = 3.83 at chance; the format alone gives ~1.5
    assert a[0] > 3.0 and min(a[-5:]) < 2.0, (a[0], a[-5:])
    # the fine-tuning run starts where the first ended (its weights), not from a fresh init
    assert b[0] < 0.7 * a[0] and abs(b[0] - sum(a[-5:]) / 5) < 0.4, (a[-5:], b[:3])

    out = tmp_path / "r.json"
    run([*CLI, "eval", "scrolls", str(second), "--task", "quality", "--data", str(kv / "validation.jsonl"),
         "--out", str(out), *SEQ])
    report = json.loads(out.read_text())
    assert report["num_predicted"] == 16 and report["generation"]["greedy"] and report["world_size"] == 1
    assert 0.0 <= report["scores"]["exact_match"] <= 100.0 and len(report["predictions"]) == 16

    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "tapetrain.cli", "eval", "scrolls",
           str(second), "--task", "quality", "--data", str(kv / "validation.jsonl"), "--out",
           str(tmp_path / "two.json"), *SEQ]
    subprocess.run(cmd, check=True, env={**env(), "PYTHONPATH": str(REPO)}, cwd=REPO, timeout=600,
                   capture_output=True)
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2 and two["predictions"] == report["predictions"]
    assert two["scores"] == report["scores"]


def test_fixture_summaries_data_fine_tune_eval(tmp_path):
    """The summary path on the local fixture records: a tokenizer trained on them, `data scrolls` (head + tail
    truncation), a few DeepSpeed steps, then `eval scrolls` sampling summaries and scoring them with ROUGE."""
    tok, data, run_dir = tmp_path / "tok.model", tmp_path / "gov", tmp_path / "run"
    run([*CLI, "data", "tokenizer", "--input", str(FIXTURES / "*.jsonl"), "--text-key", "input", "--vocab-size",
         "320", "--out", str(tok)])
    fixture = str(FIXTURES / "gov_report.jsonl")
    sizes = ["--seq-len", "64", "--max-answer-tokens", "16"]
    run([*CLI, "data", "scrolls", "--task", "gov_report", "--input", fixture, "--tokenizer", str(tok),
         "--out", str(data), *sizes])
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["task"]["records"] == 3 and manifest["task"]["truncated_prompts"] > 0
    config = write_config(tmp_path / "c.yaml", data, run_dir, model={"vocab_size": 320},
                          train={"steps": 3, "global_batch_size": 4, "save_interval": 3})
    run([*CLI, "train", str(config)])
    out = tmp_path / "gov.json"
    run([*CLI, "eval", "scrolls", str(run_dir), "--task", "gov_report", "--data", fixture, "--out", str(out), *sizes])
    report = json.loads(out.read_text())
    assert report["generation"]["greedy"] is False and report["generation"]["max_new_tokens"] == 16
    assert report["num_predicted"] == len(report["predictions"]) == 2  # 3 records, 2 ids
    scores = report["scores"]
    assert scores["scrolls_score_key"] == "rouge/geometric_mean" and {"rouge/rouge1", "rouge/rouge2"} <= set(scores)


def test_init_from_a_run_directory_and_an_export(tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "unit"))
    from test_hf_runs import make_run

    run_dir = make_run(tmp_path / "run", pe="tape", stage=2, steps=(1, 2))
    trained, _ = load_run_model(str(run_dir))
    export_hf(str(run_dir), str(tmp_path / "hf"))
    for source in (run_dir, run_dir / "checkpoints" / "step_00000002", tmp_path / "hf"):
        cfg = init_model_config(str(source), "tape")
        model = Transformer(cfg)
        assert copy_init_weights(model, str(source)) > 0
        for (name, ours), theirs in zip(model.state_dict().items(), trained.state_dict().values(), strict=True):
            assert torch.equal(ours, theirs), (source, name)
    # a RoPE model started from the TAPE run: the TAPE-only parameters are unexpected, named in the error
    with pytest.raises(ValueError, match="unexpected .*tape"):
        copy_init_weights(Transformer(init_model_config(str(run_dir), "rope")), str(run_dir))
