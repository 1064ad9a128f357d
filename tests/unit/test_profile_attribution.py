"""tools/profile_step.py counts each kernel/operator once: user annotations (torch.optim's Optimizer.step range)
are not kernels, and the category sum of a step cannot exceed its wall time (an H100 profile once showed 256.9 ms of
device time in a 252.5 ms step: AdamW's kernels counted a second time through the annotation)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from tapetrain.bench.profile import by_category, per_kernel_ms

REPO = Path(__file__).resolve().parents[2]


def test_annotations_are_not_counted_and_optimizer_operators_are():
    a = torch.randn(64, 64, requires_grad=True)
    opt = torch.optim.AdamW([a], foreach=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("my_region"):
            (a @ a).sum().backward()
        opt.step()
    annotations = {e.name for e in prof.events() if e.is_user_annotation}
    assert "my_region" in annotations and any(n.startswith("Optimizer.step#") for n in annotations)
    per = per_kernel_ms(prof.events(), torch.device("cpu"), steps=1)
    assert not any(name == "my_region" or "#" in name for name in per), sorted(per)
    assert "aten::mm" in per
    cats = by_category(per)
    assert cats["matmul"] > 0 and cats["optimizer"] > 0  # AdamW's aten ops on CPU count as the optimizer's
    total_self = sum(e.self_cpu_time_total for e in prof.events()) / 1e3
    assert sum(per.values()) < total_self  # the annotations' own time was there to be (wrongly) counted


def test_category_sum_of_a_cpu_step_is_within_its_wall_time(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "profile_step.py"), "--device", "cpu", "--preset", "tiny",
         "--seq-len", "64", "--batch", "2", "--steps", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dtype"] == "fp32" and "annotations excluded" in result["attribution"]
    for pe, r in result["pes"].items():
        assert 0 < sum(r["categories_ms"].values()) <= r["step_ms"], (pe, r["categories_ms"], r["step_ms"])
        assert r["categories_ms"]["optimizer"] > 0 and r["categories_ms"]["matmul"] > 0
        assert not any("Optimizer.step#" in k["kernel"] for k in r["top_kernels_ms"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
