"""A real 20-step DeepSpeed bf16 run of the paper's 155M TAPE model on one GPU (skipped without CUDA).

Data: a sentencepiece tokenizer (vocab 8000) trained on Python's standard library and shards written by
`prepare`, so the run goes through the same config, data, engine and checkpoint code as a user's."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    from tapetrain.data.prepare import prepare
    from tapetrain.data.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("gpu-data")
    with (root / "corpus.jsonl").open("w") as f:
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:600]:
            f.write(json.dumps({"text": path.read_text(encoding="utf-8", errors="replace")}) + "\n")
    train_tokenizer([str(root / "corpus.jsonl")], 8000, str(root / "tok.model"))
    prepare([str(root / "corpus.jsonl")], str(root / "tok.model"), str(root / "data"), val_fraction=0.01)
    return root / "data"


@pytest.mark.parametrize("pe", ["tape", "rope"])
def test_deepspeed_bf16_paper_155m_20_steps(tmp_path, shards, pe):
    out = tmp_path / "run"
    cfg = {
        "run": {"out_dir": str(out), "seed": 0},
        "model": {"preset": "paper-155m", "pe": pe, "vocab_size": 8000},
        "data": {"train": str(shards), "seq_len": 1024},
        "train": {"steps": 20, "micro_batch_size": 8, "global_batch_size": 16, "save_interval": 20,
                  "log_interval": 1},
        "optim": {"lr": 6e-4, "warmup_steps": 2},
        "deepspeed": {"zero_stage": 2, "precision": "bf16"},
    }  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "tapetrain.train", str(tmp_path / "c.yaml")], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    losses = [r["loss"] for r in steps]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # it learns
    assert steps[-1]["tokens_per_s"] > 0 and steps[-1]["mfu"] is not None and steps[-1]["mem_gb"] > 0
    assert (out / "checkpoints" / "step_00000020").is_dir()
