"""The fused (chunked) loss under a real 2-rank DeepSpeed ZeRO-3 engine (CPU, gloo) with the LM head partitioned:
same losses and full gradients as the plain logits path, tied and untied, with -100 labels."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from harness import DEEPSPEED, REPO, env, free_port

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("fused_loss_zero3_worker.py")


def test_fused_loss_equals_plain_under_zero3_with_partitioned_lm_head(tmp_path):
    out = tmp_path / "report.json"
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), str(WORKER), str(out)]
    run_env = {**env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-6000:]
    report = json.loads(out.read_text())
    for setting, result in report.items():
        # lm_head.weight (V × C = 512 × 64): each rank holds half, and nothing is resident outside its forward
        assert result["partitioned"] == [[512 * 64, 512 * 64 // 2, 0]] * 2, (setting, result["partitioned"])
        for rank_plain, rank_fused in zip(result["losses_plain"], result["losses_fused"], strict=True):
            for plain, fused in zip(rank_plain, rank_fused, strict=True):  # before and after one AdamW step
                assert abs(fused - plain) <= 1e-6 * abs(plain), (setting, rank_plain, rank_fused)
        names = result["grad_names"]
        assert ("lm_head.weight" in names) == (setting == "untied") and "embed.weight" in names
        for name, err in result["grad_rel_err"].items():
            bound = 1e-6 if name in ("lm_head.weight", "embed.weight", "norm.weight") else 5e-6
            assert err <= bound, (setting, name, err)
