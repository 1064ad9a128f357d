"""tools/benchmark.py end to end on CPU with tiny sizes (subprocesses), plus its pure helpers.

Checks only that results are produced and well-formed (performance is measured by tools/benchmark.py, never
asserted by tests).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import statistics
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

from tapetrain import bench

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "benchmark.py"


def _run(*args: str, timeout: int = 120, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # interpreter timings are meaningless and slow
    env.pop("TAPETRAIN_FLOAT8_EMULATE", None)
    env.update(extra_env or {})
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_header(result: dict, mode: str) -> None:
    """The header `report_header` gives every mode, whatever else the mode writes."""
    assert set(bench.HEADER_KEYS) <= result.keys()
    assert result["mode"] == mode and result["device"] and result["machine"] and result["versions"]["torch"]
    assert datetime.fromisoformat(result["date"]).tzinfo is not None


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
    _check_header(result, "train")
    for key in ("device", "preset", "seq_len", "batch", "dtype", "tape", "rope", "tape_over_rope_step_time"):
        assert key in result, key
    assert (result["preset"], result["seq_len"], result["batch"], result["dtype"]) == ("tiny", 64, 2, "fp32")
    for pe in ("tape", "rope"):
        _check_steps(result[pe])
        assert len(result[pe]["step_times_s"]) == 2
    assert result["tape"]["params"] > result["rope"]["params"]  # TAPE's extra weights: really two models
    assert _positive(result["tape_over_rope_step_time"])
    spread = result["tape_over_rope_step_time_spread"]  # the median of the per-round ratio, recomputable
    ratios = [a / b for a, b in zip(result["tape"]["step_times_s"], result["rope"]["step_times_s"], strict=True)]
    assert spread["median"] == pytest.approx(statistics.median(ratios))
    assert result["tape_over_rope_step_time"] == pytest.approx(spread["median"])
    assert spread["pairs"] == 2 and not result["headline"] and "not a headline" in proc.stdout
    assert result["attention_ran"] == {"backends": ["sdpa"], "cpu_sdpa_two_calls_from_keys": 1024,  # what ran
                                       "tape_updates": ["eager"]}  # auto on CPU: TAPE's E updates eager
    assert out.with_suffix(".png").stat().st_size > 0
    assert "TAPE / RoPE step time" in proc.stdout


def test_attention_mode(tmp_path: Path) -> None:
    out = tmp_path / "attn.json"
    plot = tmp_path / "custom.png"
    proc = _run("attention", "--seq-lens", "32,64", "--batch", "1", "--heads", "2", "--head-dim", "16",
                "--iters", "2", "--warmup", "1", "--no-progress", "--out", str(out), "--plot", str(plot))  # fmt: skip
    result = json.loads(out.read_text())
    _check_header(result, "attention")
    assert result["dtype"] == "fp32" and result["seq_lens"] == [32, 64]
    cases = {(r["seq_len"], r["pe"], r["backend"]) for r in result["results"]}
    tape_backends = ("eager", "sdpa", "sdpa:one_call", "sdpa:two_calls")
    expected = (("rope", "sdpa"), *(("tape", b) for b in tape_backends))
    assert cases == {(t, pe, b) for t in (32, 64) for pe, b in expected}
    for r in result["results"]:
        assert "error" not in r and _positive(r["fwd_ms"]) and _positive(r["fwd_bwd_ms"])
        assert len(r["fwd_bwd_ms_per_round"]) == 2
        assert r["fwd_bwd_ms_spread"]["median"] == pytest.approx(r["fwd_bwd_ms"])
    assert [r["seq_len"] for r in result["tape_over_rope_fwd_bwd"]] == [32, 64]
    assert all(_positive(r["ratio"]) and r["spread"]["pairs"] == 2 for r in result["tape_over_rope_fwd_bwd"])
    split = [p for p in result["pair_ratios"] if p["kind"] == "sdpa_two_calls_over_one_call"]
    assert [p["seq_len"] for p in split] == [32, 64] and not result["headline"] and result["pairs"] == 2
    assert "two calls (V, E) / one [V ‖ E] call" in proc.stdout and "not a headline" in proc.stdout
    assert any("triton skipped" in n for n in result["notes"])
    assert plot.stat().st_size > 0 and not out.with_suffix(".png").exists()
    assert "TAPE / RoPE fwd+bwd" in proc.stdout


def test_engine_mode(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    _run("engine", "--preset", "tiny", "--seq-len", "32", "--batch", "2", "--steps", "2", "--warmup", "1",
         "--no-progress", "--out", str(out), "--no-plot")  # fmt: skip
    result = json.loads(out.read_text())
    _check_header(result, "engine")
    assert result["zero_stage"] == 2 and result["ds_config"]["zero_optimization"]["stage"] == 2
    assert result["ds_config"]["gradient_clipping"] == 1.0
    _check_steps(result["plain"])
    _check_steps(result["deepspeed"])
    # Same model, data and optimizer: the losses after the same steps agree (fp32, clipping on both sides).
    assert result["plain"]["final_loss"] == pytest.approx(result["deepspeed"]["final_loss"], rel=1e-4)
    assert _positive(result["deepspeed_over_plain_tokens_per_s"])
    ratios = [a / b for a, b in zip(result["plain"]["step_times_s"], result["deepspeed"]["step_times_s"], strict=True)]
    assert result["deepspeed_over_plain_tokens_per_s"] == pytest.approx(statistics.median(ratios))
    assert result["deepspeed_over_plain_spread"]["pairs"] == 2 and not result["headline"]
    assert result["attention_ran"]["backends"] == ["sdpa"]
    assert not out.with_suffix(".png").exists()


def test_data_mode(tmp_path: Path) -> None:
    """The data benchmark lives in the package (it used to be a script that the package loaded by path)."""
    out = tmp_path / "data.json"
    proc = _run("data", "--corpus-mb", "0.05", "--vocab", "300", "--reader-tokens", "20000", "--seq-lens", "32,64",
                "--seconds", "0.05", "--remote-latency-ms", "5", "--remote-shard-tokens", "4000",
                "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    _check_header(result, "data")
    assert [p["workers"] for p in result["prepare"]] == [1, 2] and result["prepare_identical_1_vs_2_workers"]
    assert all(
        _positive(p["tokens_per_s"]) and p["tokens"] == result["prepare"][0]["tokens"] for p in result["prepare"]
    )
    assert [r["seq_len"] for r in result["reader"]] == [32, 64]
    assert all(_positive(r["tokens_per_s"]) for r in result["reader"])
    assert "identical shards: True" in proc.stdout
    remote = result["remote_reader"]  # over HTTP on 127.0.0.1: a cold then a warm cache per seq_len
    assert [(r["seq_len"], r["cache"]) for r in remote] == [(32, "cold"), (32, "warm"), (64, "cold"), (64, "warm")]
    assert all(_positive(r["tokens_per_s"]) for r in remote) and remote[1]["fetched_mb"] == 0 < remote[0]["fetched_mb"]


def test_sp_mode(tmp_path: Path) -> None:
    """Two CPU ranks over gloo, a few pairs: the record is well-formed, the sharded model computes the same loss,
    and each rank saves fewer bytes for backward at SP 2 than at SP 1 (a property, not a timing)."""
    out = tmp_path / "sp.json"
    proc = _run("sp", "--ranks", "2", "--preset", "tiny", "--seq-len", "64", "--pairs", "2", "--warmup", "1",
                "--allow-few-pairs", "--no-progress", "--out", str(out), timeout=300)  # fmt: skip
    result = json.loads(out.read_text())
    _check_header(result, "sp")
    assert (result["ranks"], result["pairs"], result["headline"]) == (2, 2, False)
    assert result["peak_mem_kind"] == "saved_for_backward" and result["dist_backend"] == "gloo"
    assert result["attention_backends_ran"] and result["versions"]["torch"]
    assert {(r["pe"], r["sp"]) for r in result["results"]} == {(pe, sp) for pe in ("tape", "rope") for sp in (1, 2)}
    for r in result["results"]:
        assert len(r["step_times_s"]) == 2 and _positive(r["tokens_per_s_per_group"])
        assert r["tokens_per_rank"] == 64 // r["sp"] and len(r["saved_bytes_per_rank"]) == 2
    for p in result["pairs_by_pe"]:
        assert p["pairs"] == 2 and len(p["pair_ratios"]) == 2 and p["headline_step_time_ratio"] is None
        assert p["saved_bytes_ratio"] < 1
        assert abs(p["loss_sp_n_minus_sp1"]) < 1e-4
    by = {(r["pe"], r["sp"]): r["saved_bytes_per_rank"] for r in result["results"]}
    for pe in ("tape", "rope"):
        assert max(by[pe, 2]) < min(by[pe, 1])
    assert out.with_suffix(".png").stat().st_size > 0
    assert "not a headline" in proc.stdout


def test_docmask_mode(tmp_path: Path) -> None:
    """A few pairs of the training step with and without the document mask: the record is well-formed (no timing
    is asserted), both variants start from the same weights, and the mask ran through an attention backend."""
    out = tmp_path / "docmask.json"
    proc = _run("docmask", "--preset", "tiny", "--seq-len", "64", "--docs", "4", "--pairs", "2", "--warmup", "1",
                "--allow-few-pairs", "--threads", "1", "--no-progress", "--out", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    _check_header(result, "docmask")
    assert (result["mode"], result["seq_len"], result["docs_per_row"], result["pairs"]) == ("docmask", 64, 4, 2)
    assert result["headline"] is False and result["mask_over_no_mask"]["headline_step_time_ratio"] is None
    assert len(result["doc_lengths"]) == 4 and sum(result["doc_lengths"]) == 64 and min(result["doc_lengths"]) >= 1
    assert result["versions"]["torch"] and result["attention_backend"] == "auto"
    assert all(result["attention_backends_ran"][v] for v in ("no_mask", "mask"))
    assert [r["variant"] for r in result["results"]] == ["no_mask", "mask"]
    for r in result["results"]:
        assert len(r["step_times_s"]) == 2 and _positive(r["tokens_per_s"]) and math.isfinite(r["first_loss"])
        assert set(r["step_s"]) == {"median", "q1", "q3", "min", "max"}
    ratio = result["mask_over_no_mask"]
    assert ratio["pairs"] == 2 and all(_positive(x) for x in ratio["pair_ratios"])
    assert result["results"][0]["first_loss"] != result["results"][1]["first_loss"]  # the mask changes the loss
    assert out.with_suffix(".png").stat().st_size > 0
    assert "step time mask / no mask" in proc.stdout and "not a headline" in proc.stdout


def test_docmask_settings_refuse_few_pairs_and_bad_docs() -> None:
    with pytest.raises(ValueError, match="--allow-few-pairs"):
        bench.check_docmask_settings(bench.DocmaskSettings(pairs=bench.MIN_HEADLINE_PAIRS - 1))
    with pytest.raises(ValueError, match="--docs"):
        bench.check_docmask_settings(bench.DocmaskSettings(seq_len=8, docs=9))
    bench.check_docmask_settings(bench.DocmaskSettings(pairs=2, allow_few_pairs=True))


def test_a_set_of_what_a_mode_option_decides_is_refused() -> None:
    """`docmask --set attn_backend=triton` ran `auto` on the H200 (2026-11-27): the mode's --backend replaced it."""
    from tapetrain.bench.steps import build_model

    with pytest.raises(ValueError, match="--set attn_backend: set --backend instead"):
        build_model("tiny", "tape", 64, backend="auto", overrides={"attn_backend": "triton"})
    with pytest.raises(ValueError, match="--set pe: set --pe/--pe-list instead"):
        build_model("tiny", "tape", 64, overrides={"pe": "rope"})
    assert build_model("tiny", "tape", 64, backend="eager", overrides={"n_layers": 1}).cfg.attn_backend == "eager"


# ---- one header and one argument helper for every mode ---------------------------------------------------------


def _modes() -> dict[str, argparse.ArgumentParser]:
    from tapetrain.bench.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_mode_has_the_shared_report_options() -> None:
    """Each mode's parser starts from `add_report_args`: its group is there, with --out, in every mode (and every
    mode of the package is a subcommand)."""
    from tapetrain.bench.arguments import REPORT_GROUP

    modes = _modes()
    assert set(modes) == {"attention", "train", "engine", "layer", "sp", "cp", "docmask", "data", "bakeoff"}
    for mode, parser in modes.items():
        groups = {g.title: g for g in parser._action_groups}
        assert REPORT_GROUP in groups, f"{mode} does not use add_report_args"
        assert ["--out"] in [a.option_strings for a in groups[REPORT_GROUP]._group_actions], mode


def _calls_and_keys(path: Path) -> tuple[list[ast.Call], set[str]]:
    tree = ast.parse(path.read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    keys = {k.value for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys
            if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return calls, keys


def test_every_mode_takes_its_header_from_report_header() -> None:
    """No mode (nor a helper module of the modes) writes a header field or asks for the versions itself: each
    mode's module calls report_header with its own name, so every report carries the same header."""
    package = REPO / "tapetrain" / "bench"
    own = {"mode", "date", "machine", "versions"}  # the header's fields; "device" also names raw per-rank records
    for path in sorted(package.glob("*.py")):
        if path.name in ("header.py", "campaign_record.py"):  # campaign_record: GPU test campaigns, no report
            continue
        calls, keys = _calls_and_keys(path)
        assert not own & keys, f"{path.name} writes header fields itself: {sorted(own & keys)}"
        assert not [c for c in calls if ast.unparse(c.func).endswith("software_versions")], path.name
    for mode in _modes():
        calls, _ = _calls_and_keys(package / f"{mode}.py")
        named = [c.args[0].value for c in calls if ast.unparse(c.func) == "report_header"
                 and c.args and isinstance(c.args[0], ast.Constant)]
        assert named == [mode], f"{mode}.py must build its header with report_header({mode!r}, ...)"


# ---- pure helpers ---------------------------------------------------------------------------------------------


def test_write_json_atomic_is_strict_json(tmp_path: Path) -> None:
    path = bench.write_json_atomic(tmp_path / "sub" / "r.json", {"mfu": math.nan, "x": (1.5, math.inf)})
    assert json.loads(path.read_text()) == {"mfu": None, "x": [1.5, None]}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temp file left behind


def test_attention_cases_filter_and_validation() -> None:
    cpu = torch.device("cpu")
    cases, _ = bench.attention_cases(cpu, torch.float32, ["sdpa"])  # the family: both forced strategies too
    assert {(c.pe, c.backend) for c in cases} == {
        ("rope", "sdpa"), ("tape", "sdpa"), ("tape", "sdpa:one_call"), ("tape", "sdpa:two_calls")
    }
    cases, notes = bench.attention_cases(cpu, torch.float32, ["flash"])  # no CUDA here: nothing, and says why
    assert cases == [] and any("flash" in n for n in notes)
    with pytest.raises(ValueError, match="unknown"):
        bench.attention_cases(cpu, torch.float32, ["cudnn"])


def test_attention_flops_rope_backward_is_2_5x_forward() -> None:
    fwd, bwd = bench.attention_flops(1, 1, 128, 64, 64)
    assert bwd / fwd == pytest.approx(2.5)
    tape_fwd, _ = bench.attention_flops(1, 1, 128, 64, 128)
    assert tape_fwd / fwd == pytest.approx(1.5)  # QKᵀ once, values twice as wide


def test_sp_settings_refuse_few_pairs() -> None:
    settings = bench.SpSettings(preset="tiny", seq_len=64, pairs=bench.MIN_HEADLINE_PAIRS - 1)
    with pytest.raises(ValueError, match="--allow-few-pairs"):
        bench.check_sp_settings(settings)
    settings.allow_few_pairs = True
    bench.check_sp_settings(settings)
    with pytest.raises(ValueError, match="multiple"):
        bench.check_sp_settings(bench.SpSettings(preset="tiny", seq_len=63, allow_few_pairs=True))


def test_parse_overrides() -> None:
    assert bench.parse_overrides(["n_layers=4", "tie_embeddings=true"]) == {"n_layers": 4, "tie_embeddings": True}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        bench.parse_overrides(["n_layers"])


def test_interleaved_rounds_rotate_the_order() -> None:
    """Every round runs each variant once, the order rotated: on a shared machine a slow moment then falls on every
    variant of that round instead of on whichever ran during it (why one-after-another timings swung 0.90-1.46)."""
    from tapetrain.bench.pairs import interleaved_times, pair_ratios

    order: list[str] = []
    calls = {name: (lambda name=name: order.append(name)) for name in "abc"}
    times = interleaved_times(calls, torch.device("cpu"), warmup=1, rounds=3)
    assert "".join(order) == "abc" + "abc" + "bca" + "cab"
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    ratio = pair_ratios([2.0, 4.0, 6.0], [1.0, 1.0, 2.0])
    assert ratio["median"] == 3.0 and (ratio["min"], ratio["max"]) == (2.0, 4.0)
    assert ratio["pairs"] == 3 and not ratio["headline"]
    assert pair_ratios([1.0] * 10, [1.0] * 10)["headline"]


def test_warm_up_runs_until_the_ratio_is_steady() -> None:
    """A drifting start (the H200's first docmask ratios, 1.27-1.41 before a steady 1.13) keeps the warm-up going;
    it stops at the first round whose last three ratios are within 5% of their median, never before the minimum,
    and gives up at the maximum saying the ratio never settled."""
    from tapetrain.bench.pairs import is_steady, warm_until_steady

    drift = [1.36, 1.33, 1.29, 1.27, 1.41, 1.41, 1.28, 1.13, 1.12, 1.14, 1.13, 1.13]
    record = warm_until_steady(lambda r: (drift[r], 1.0), min_rounds=3, max_rounds=20)
    assert record["rounds"] == 12 and record["steady"] and record["ratios"] == drift  # not at 1.36/1.33/1.29
    assert not any(is_steady(drift[:n]) for n in range(1, 12))
    assert warm_until_steady(lambda r: (1.2, 1.0), min_rounds=8, max_rounds=12)["rounds"] == 8
    wild = warm_until_steady(lambda r: (1.0 + (r % 2) * 0.3, 1.0), min_rounds=2, max_rounds=7)
    assert wild["rounds"] == 7 and not wild["steady"]
    assert not is_steady([1.0, 1.2]) and is_steady([1.0, 1.01, 0.99, 1.0, 1.02, 0.99])


def test_train_mode_alternates_float8_variants(tmp_path: Path) -> None:
    """--float8-list: each PE's float8 variant (torchao's emulation on CPU) alternates with its high-precision twin;
    the speed ratio is the per-round median of their step times."""
    out = tmp_path / "train.json"
    proc = _run("train", "--preset", "tiny", "--seq-len", "64", "--batch", "2", "--steps", "2", "--warmup", "1",
                "--pe-list", "rope", "--float8-list", "off,rowwise", "--no-progress", "--out", str(out),
                extra_env={"TAPETRAIN_FLOAT8_EMULATE": "1"})  # fmt: skip
    result = json.loads(out.read_text())
    assert result["pe_list"] == ["rope", "rope+float8-rowwise"] and result["float8_list"] == ["off", "rowwise"]
    for name in result["pe_list"]:
        _check_steps(result[name])
    assert result["rope"]["final_loss"] != result["rope+float8-rowwise"]["final_loss"]  # FP8 rounding ran
    ratios = [a / b for a, b in zip(result["rope"]["step_times_s"], result["rope+float8-rowwise"]["step_times_s"],
                                    strict=True)]
    assert result["float8_speedup"]["rope+float8-rowwise"]["median"] == pytest.approx(statistics.median(ratios))
    assert "rope+float8-rowwise: " in proc.stdout


def test_train_mode_refuses_float8_on_a_cpu_in_one_line() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.pop("TAPETRAIN_FLOAT8_EMULATE", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), "train", "--preset", "tiny", "--seq-len", "64", "--steps", "1",
                           "--pe-list", "rope", "--float8-list", "off,rowwise"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error: train.float8=rowwise on cpu" in proc.stderr and "set train.float8=off" in proc.stderr
