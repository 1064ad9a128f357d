"""No host synchronisation inside a micro-step: the loss sum and the finiteness flags stay on the device and are
read once per optimizer step, so tapetrain's host reads per step do not grow with gradient accumulation."""

import json
import sys
from pathlib import Path

import pytest
from harness import run, write_config

pytestmark = pytest.mark.slow


def test_host_reads_per_step_do_not_grow_with_accumulation(shard_dir, tmp_path):
    probe = Path(__file__).parent / "host_read_probe.py"
    results = {}
    for micro in (8, 2):  # global batch 8 on one rank: 1 and 4 micro-batches per optimizer step
        cfg = write_config(tmp_path / f"m{micro}.yaml", shard_dir, tmp_path / f"run{micro}",
                           train={"micro_batch_size": micro, "steps": 4})  # fmt: skip
        out = tmp_path / f"m{micro}.json"
        run([sys.executable, str(probe), str(cfg), str(out)])
        results[micro] = json.loads(out.read_text())
    one, four = results[8], results[2]
    assert (one["grad_accum_steps"], four["grad_accum_steps"]) == (1, 4)
    assert four["ours_per_step"] == one["ours_per_step"], (one["ours"], four["ours"])
    assert four["ours_per_step"] <= 2, four["ours"]  # the reduced totals and the grad norm


def test_validation_builds_no_autograd_graph(shard_dir, tmp_path):
    """Issue #40: Trainer.validate runs without gradients: autograd saves no tensor for a backward pass."""
    probe = Path(__file__).parent / "validation_graph_probe.py"
    cfg = write_config(tmp_path / "v.yaml", shard_dir, tmp_path / "run",
                       data={"val": str(shard_dir)}, train={"eval_steps": 1})  # fmt: skip
    out = tmp_path / "v.json"
    run([sys.executable, str(probe), str(cfg), str(out)])
    result = json.loads(out.read_text())
    assert result["saved_for_backward"] == 0, result
    assert result["training_mode"] and result["val_loss"] > 0, result
