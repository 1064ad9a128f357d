"""SCROLLS end to end through the public commands on local files: synthetic long-context records in SCROLLS' format
-> `tapetrain scrolls data` -> train -> fine-tune from that run directory (model.init_from) -> `eval-scrolls`, which
reaches high exact match: the supervised path learns. Also init_from with a tapetrain run directory and export."""

import json
import sys

import pytest
import torch
from harness import REPO, run

from tapetrain.checkpoint.hf_export import export_hf
from tapetrain.checkpoint.init_source import copy_init_weights, init_model_config
from tapetrain.checkpoint.run_loader import load_run_model
from tapetrain.model import Transformer

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "tapetrain.cli"]
SEQ = ["--seq-len", "64", "--max-answer-tokens", "8"]


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def test_synthetic_scrolls_task_fine_tunes_to_high_exact_match(tmp_path):
    kv, data = tmp_path / "kv", tmp_path / "kv-data"
    run([sys.executable, str(REPO / "tools" / "synthetic_scrolls.py"), "--out", str(kv), "--train", "6000",
         "--validation", "100"])
    run([*CLI, "scrolls", "data", "--task", "quality", "--input", str(kv / "train.jsonl"), "--tokenizer",
         str(kv / "tokenizer.model"), "--out", str(data), *SEQ])
    config = str(REPO / "configs" / "scrolls-synthetic-cpu.yaml")
    first, second = tmp_path / "pretrain", tmp_path / "finetune"
    run([*CLI, "train", config, f"run.out_dir={first}", f"data.train={data}", "train.steps=100"])
    run([*CLI, "train", config, f"run.out_dir={second}", f"data.train={data}", f"model.init_from={first}",
         "train.steps=900", "run.seed=7"], timeout=1800)
    a, b = losses(first), losses(second)
    assert b[0] < 0.7 * a[0] and abs(b[0] - a[-1]) < 0.3  # continues from the trained weights, not from scratch
    out = tmp_path / "r.json"
    run([*CLI, "eval-scrolls", str(second), "--task", "quality", "--data", str(kv / "validation.jsonl"),
         "--out", str(out), *SEQ])
    report = json.loads(out.read_text())
    assert report["num_predicted"] == 100 and report["generation"]["greedy"]
    assert report["scores"]["exact_match"] >= 90.0, report["scores"]
    print(f"synthetic SCROLLS-format retrieval: exact match {report['scores']['exact_match']:.1f}%")


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
