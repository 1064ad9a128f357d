"""tools/benchmark.py end to end on CPU with tiny sizes (subprocesses), plus its pure helpers.

Checks only that results are produced and well-formed (performance is measured by tools/benchmark.py, never
asserted by tests).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tapetrain import bench

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "benchmark.py"


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # interpreter timings are meaningless and slow
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_steps(r: dict) -> None:
    assert _positive(r["tokens_per_s"]) and _positive(r["step_s"])
    assert r["mfu"] is None  # CPU: unknown peak and no --peak-tflops
    assert r["peak_mem_gb"] is None or r["peak_mem_gb"] >= 0
    assert math.isfinite(r["final_loss"])


def test_train_mode(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    proc = _run("train", "--preset", "tiny", "--seq-len", "64", "--batch", "2", "--steps", "2", "--warmup", "1",
                "--no-progress", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    for key in ("device", "preset", "seq_len", "batch", "dtype", "tape", "rope", "tape_over_rope_step_time"):
        assert key in result, key
    assert (result["preset"], result["seq_len"], result["batch"], result["dtype"]) == ("tiny", 64, 2, "fp32")
    for pe in ("tape", "rope"):
        _check_steps(result[pe])
        assert len(result[pe]["step_times_s"]) == 2
    assert result["tape"]["params"] > result["rope"]["params"]  # TAPE's extra weights: really two models
    assert _positive(result["tape_over_rope_step_time"])
    assert out.with_suffix(".png").stat().st_size > 0
    assert "TAPE / RoPE step time" in proc.stdout


def test_attention_mode(tmp_path: Path) -> None:
    out = tmp_path / "attn.json"
    plot = tmp_path / "custom.png"
    proc = _run("attention", "--seq-lens", "32,64", "--batch", "1", "--heads", "2", "--head-dim", "16",
                "--iters", "2", "--warmup", "1", "--no-progress", "--out", str(out), "--plot", str(plot))  # fmt: skip
    result = json.loads(out.read_text())
    assert result["dtype"] == "fp32" and result["seq_lens"] == [32, 64]
    cases = {(r["seq_len"], r["pe"], r["backend"]) for r in result["results"]}
    assert cases == {(t, pe, b) for t in (32, 64) for pe, b in (("rope", "sdpa"), ("tape", "eager"), ("tape", "sdpa"))}
    for r in result["results"]:
        assert "error" not in r and _positive(r["fwd_ms"]) and _positive(r["fwd_bwd_ms"])
    assert [r["seq_len"] for r in result["tape_over_rope_fwd_bwd"]] == [32, 64]
    assert all(_positive(r["ratio"]) for r in result["tape_over_rope_fwd_bwd"])
    assert any("triton skipped" in n for n in result["notes"])
    assert plot.stat().st_size > 0 and not out.with_suffix(".png").exists()
    assert "TAPE / RoPE fwd+bwd" in proc.stdout


def test_engine_mode(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    _run("engine", "--preset", "tiny", "--seq-len", "32", "--batch", "2", "--steps", "2", "--warmup", "1",
         "--no-progress", "--out", str(out), "--no-plot")  # fmt: skip
    result = json.loads(out.read_text())
    assert result["zero_stage"] == 2 and result["ds_config"]["zero_optimization"]["stage"] == 2
    assert result["ds_config"]["gradient_clipping"] == 1.0
    _check_steps(result["plain"])
    _check_steps(result["deepspeed"])
    # Same model, data and optimizer: the losses after the same steps agree (fp32, clipping on both sides).
    assert result["plain"]["final_loss"] == pytest.approx(result["deepspeed"]["final_loss"], rel=1e-4)
    assert _positive(result["deepspeed_over_plain_tokens_per_s"])
    assert not out.with_suffix(".png").exists()


def test_data_mode(tmp_path: Path) -> None:
    """The data benchmark lives in the package (it used to be a script that the package loaded by path)."""
    out = tmp_path / "data.json"
    proc = _run("data", "--corpus-mb", "0.05", "--vocab", "300", "--reader-tokens", "20000", "--seq-lens", "32,64",
                "--seconds", "0.05", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert [p["workers"] for p in result["prepare"]] == [1, 2] and result["prepare_identical_1_vs_2_workers"]
    assert all(_positive(p["tokens_per_s"]) and p["tokens"] == result["prepare"][0]["tokens"]
               for p in result["prepare"])
    assert [r["seq_len"] for r in result["reader"]] == [32, 64]
    assert all(_positive(r["tokens_per_s"]) for r in result["reader"])
    assert "identical shards: True" in proc.stdout


# ---- pure helpers ---------------------------------------------------------------------------------------------


def test_write_json_atomic_is_strict_json(tmp_path: Path) -> None:
    path = bench.write_json_atomic(tmp_path / "sub" / "r.json", {"mfu": math.nan, "x": (1.5, math.inf)})
    assert json.loads(path.read_text()) == {"mfu": None, "x": [1.5, None]}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temp file left behind


def test_attention_cases_filter_and_validation() -> None:
    cpu = torch.device("cpu")
    cases, _ = bench.attention_cases(cpu, torch.float32, ["sdpa"])
    assert {(c.pe, c.backend) for c in cases} == {("rope", "sdpa"), ("tape", "sdpa")}
    cases, notes = bench.attention_cases(cpu, torch.float32, ["flash"])  # no CUDA here: nothing, and says why
    assert cases == [] and any("flash" in n for n in notes)
    with pytest.raises(ValueError, match="unknown"):
        bench.attention_cases(cpu, torch.float32, ["cudnn"])


def test_attention_flops_rope_backward_is_2_5x_forward() -> None:
    fwd, bwd = bench.attention_flops(1, 1, 128, 64, 64)
    assert bwd / fwd == pytest.approx(2.5)
    tape_fwd, _ = bench.attention_flops(1, 1, 128, 64, 128)
    assert tape_fwd / fwd == pytest.approx(1.5)  # QKᵀ once, values twice as wide


def test_parse_overrides() -> None:
    assert bench.parse_overrides(["n_layers=4", "tie_embeddings=true"]) == {"n_layers": 4, "tie_embeddings": True}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        bench.parse_overrides(["n_layers"])
