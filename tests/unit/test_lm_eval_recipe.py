"""The README's lm-evaluation-harness recipe on a tiny TAPE export, with a local multiple-choice task (no hub):

    lm_eval --model hf --model_args pretrained=EXPORT,trust_remote_code=True --tasks ... --include_path DIR

Every log-likelihood the harness reports must equal the one tapetrain's own model computes for the same tokens
(BOS + context + continuation, as the harness encodes them), and so must the accuracy. lm-eval is an optional
extra (`pip install -e ".[lm-eval]"` in a clone of tapetrain); without it this test is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_helpers import build, randomize_tape
from test_hf_runs import train_tiny_tokenizer

from tapetrain.checkpoint.hf_export import export_model

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

DOCS = [
    {"question": "Hello, world! Numbers", "choices": ["0123456789", "and punctuation"], "label": 0},
    {"question": "What is the pass key?", "choices": ["The pass key is 4711.", "done."], "label": 0},
    {"question": "e.g. 3.14", "choices": ["-- done.", "(a) [b] {c}"], "label": 1},
]
TASK = """\
task: tapetrain_smoke
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def tapetrain_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) in float64, tokens split the harness's way (whole string, then the context)."""
    ctx = tokenizer(context)["input_ids"]  # with BOS, as the harness encodes for this tokenizer
    cont = tokenizer(context + continuation)["input_ids"][len(ctx):]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits  # (1, T - 1, V)
    logp = torch.log_softmax(logits.double(), dim=-1)[0, len(ctx) - 1:]  # predictions of the continuation
    return float(logp.gather(-1, torch.tensor(cont)[:, None]).sum())


def test_lm_eval_harness_scores_our_export(tmp_path):
    from transformers import AutoTokenizer

    model = build("tape")
    randomize_tape(model)  # TAPE's state updates active: the remote code must compute them too
    export_model(model, str(tmp_path / "hf"), tokenizer=train_tiny_tokenizer(tmp_path / "tok.model"))
    (tmp_path / "tasks").mkdir()
    data = tmp_path / "tasks" / "smoke.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tasks" / "tapetrain_smoke.yaml").write_text(TASK.format(data=data))
    lm_eval = shutil.which("lm_eval", path=str(Path(sys.executable).parent)) or "lm_eval"
    cmd = [lm_eval, "--model", "hf", "--model_args", f"pretrained={tmp_path / 'hf'},trust_remote_code=True",
           "--tasks", "tapetrain_smoke", "--include_path", str(tmp_path / "tasks"), "--device", "cpu",
           "--batch_size", "1", "--output_path", str(tmp_path / "out"), "--log_samples"]
    # A fresh process as a user runs it: not the rank variables other in-process tests leave in os.environ
    # (with them, accelerate would try to join this test process's process group).
    rank_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in rank_vars}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    (samples_file,) = (tmp_path / "out").rglob("samples_tapetrain_smoke_*.jsonl")
    acc = json.loads(results_file.read_text())["results"]["tapetrain_smoke"]["acc,none"]
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), trust_remote_code=True)
    correct = 0
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == len(DOCS)
    for sample in samples:
        ours = [tapetrain_loglikelihood(model, tokenizer, a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        theirs = [float(r[0][0]) for r in sample["resps"]]
        assert theirs == pytest.approx(ours, abs=1e-3), (sample["doc"], theirs, ours)
        correct += max(range(len(ours)), key=ours.__getitem__) == sample["doc"]["label"]
    assert acc == pytest.approx(correct / len(DOCS))
