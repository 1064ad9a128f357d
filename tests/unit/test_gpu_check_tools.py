"""The parts of the GPU tooling that run without a GPU: gpu_check.sh's dry run and stage selection, the wheel
folder `make gpu-wheels` builds (installed with no index), and the kernels' register budget (ptxas, no GPU)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu_check.sh"


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def _planned(stdout: str) -> list[str]:
    return [line.split("]")[0].strip(" [") for line in stdout.splitlines() if "] (estimate" in line]


def test_dry_run_plans_stages_by_priority_within_the_budget(tmp_path):
    """Default budget 540 s: the tests (last campaign's failures first, flash-attn-4's after the others, several
    pytest-xdist workers), the record, then the decisive benchmarks (fused updates off, then on, before the
    bake-off); what does not fit is listed as skipped. A budget large enough plans every stage."""
    proc = _check(str(tmp_path / "out"), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    planned = _planned(proc.stdout)
    assert planned[:8] == ["install", "env", "gpu-tests-first", "gpu-tests", "gpu-tests-fa4", "kernel-record",
                           "train-1b-compile", "train-1b-compile-fused"]
    assert "bakeoff" not in planned and "-n 4 --dist loadfile -m 'gpu or verifies'" in proc.stdout
    assert "budget 540s" in proc.stdout and "] skipped: its estimate" in proc.stdout
    assert "-m 'gpu or verifies'" in proc.stdout and "benchmark.py train --preset llama-1b" in proc.stdout
    every = _planned(_check(str(tmp_path / "out"), "--dry-run", "--budget", "100000").stdout)
    for stage in ("install", "gpu-tests", "gpu-tests-fa4", "bakeoff", "bakeoff-gqa", "kernel-tune", "attention-d64",
                  "attention-d128", "train-155m-compile", "train-1b", "profile-1b", "engine-155m", "layer-memory",
                  "docmask-155m", "train-1b-float8", "float8-curve-155m"):  # fmt: skip
        assert stage in every, stage
    assert not any((tmp_path / "out").iterdir())  # a dry run writes nothing
    assert _check(str(tmp_path), "--budget", "soon").returncode == 2


def test_only_and_skip_select_stages(tmp_path):
    proc = _check(str(tmp_path), "--dry-run", "--only", "env,train-155m-compile")
    assert proc.returncode == 0
    assert _planned(proc.stdout) == ["env", "train-155m-compile"]
    proc = _check(str(tmp_path), "--dry-run", "--skip", "gpu-tests", "--budget", "100000")
    assert "[gpu-tests]" not in proc.stdout and "[train-1b]" in proc.stdout
    assert _check(str(tmp_path), "--bogus").returncode == 2


def test_the_newest_campaigns_failures_run_first(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from gpu_summary import last_failed
    finally:
        sys.path.pop(0)
    case = '<testcase classname="tests.unit.test_a" name="test_{}[x]" time="1">{}</testcase>'
    for name, body in (("h100-2026-11-23", "<failure message='old'/>"), ("h200-2026-11-26", "<failure message='m'/>"),
                       ("h200-2026-11-27", "")):  # fmt: skip
        (tmp_path / name).mkdir()
        xml = f"<testsuites><testsuite>{case.format(name[-2:], body)}{case.format('ok', '')}</testsuite></testsuites>"
        (tmp_path / name / "gpu-tests.xml").write_text(xml)
    assert last_failed(tmp_path) == []  # the newest campaign passed everything
    (tmp_path / "h200-2026-11-27" / "gpu-tests.xml").unlink()
    failing = case.format("27", "<error message='e'/>")
    (tmp_path / "h200-2026-11-27" / "gpu-tests-first.xml").write_text(
        f"<testsuites><testsuite>{failing}</testsuite></testsuites>")
    assert last_failed(tmp_path) == ["tests/unit/test_a.py::test_27[x]"]


def test_summary_reads_the_committed_h200_campaign():
    """summary.md's figures come from the campaign's JSON: the committed H200 run of 2026-11-27."""
    out = REPO / "docs" / "benchmarks" / "gpu" / "h200-2026-11-27"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_summary.py"), str(out)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    train = json.loads((out / "train-llama-1b-compile.json").read_text())
    ratio = train["tape_over_rope_step_time"]
    assert ratio > 1.10 and f"| {ratio:.3f}× | ≤ 1.1× | no |" in proc.stdout  # TAPE's step target: missed
    assert f"| {train['rope']['mfu']:.1%} | ≥ 45% | yes |" in proc.stdout
    assert "## Tests: 39 passed, 0 failed, 9 skipped" in proc.stdout


def test_stages_past_the_budget_are_skipped_and_summarised(tmp_path):
    """A real run with no budget left: nothing starts, summary.tsv and summary.md say each stage was skipped."""
    proc = _check(str(tmp_path / "out"), "--budget", "0", "--only", "env,gpu-tests,train-1b-compile")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = (tmp_path / "out" / "summary.tsv").read_text().splitlines()[1:]
    assert [row.split("\t")[:2] for row in rows] == [["env", "skipped"], ["gpu-tests", "skipped"],
                                                      ["train-1b-compile", "skipped"]]  # fmt: skip
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| gpu-tests | skipped (budget) |" in summary
    assert "| TAPE/RoPE step (train-llama-1b-compile.json) | not measured | ≤ 1.1 |" in summary


def test_missing_wheels_fail_the_install_stage_clearly(tmp_path):
    env = dict(os.environ, TAPETRAIN_GPU_WHEELS=str(tmp_path / "none"), TAPETRAIN_GPU_SITE=str(tmp_path / "site"))
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "--only", "install"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert proc.returncode == 1
    assert "no wheels in" in (tmp_path / "out" / "install.log").read_text()
    assert "install\t1\t" in (tmp_path / "out" / "summary.tsv").read_text()


@pytest.mark.slow
def test_gpu_wheels_install_without_an_index(tmp_path):
    """`make gpu-wheels` (for this machine's Python, so the result can be imported here) gives parts that each fit
    one device call (≤ 54 MiB, the repository's ~8 MiB on top stay under the 64 MiB a call carries; part-1 alone
    holds all but flash-attn-4's set); installed one after the other with no index (tools/gpu_wheels.py, as
    gpu_check.sh's install stage does), the wheels are
    byte for byte those downloaded, and DeepSpeed and flash-attn-4's files come from that target alone."""
    wheels = tmp_path / "wheels"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    cmd = ["make", "-s", "gpu-wheels", f"GPU_PYTHON={py}", f"GPU_WHEELS_DIR={wheels}", f"PYTHON={sys.executable}"]
    make = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    offline = ("Network is unreachable", "Temporary failure in name resolution", "Failed to establish")
    if make.returncode != 0 and any(s in make.stderr for s in offline):
        pytest.skip("no package registry reachable to build the wheel folder (make gpu-wheels needs one)")
    assert make.returncode == 0, make.stderr[-2000:]
    manifest = json.loads((wheels / "manifest.json").read_text())
    names = sorted(name.split("-")[0].lower() for name in manifest["wheels"])
    assert {"deepspeed", "hjson", "pydantic", "pydantic_core", "zstandard", "flash_attn_4", "nvidia_cutlass_dsl",
            "nvidia_cutlass_dsl_libs_cu13", "quack_kernels", "apache_tvm_ffi", "torch_c_dlpack_ext",
            "torchao"} <= set(names)
    parts = sorted(wheels.glob("part-*"))
    assert len(parts) == manifest["parts"] >= 2 and not list(wheels.glob("*.whl"))
    for part in parts:
        assert sum(f.stat().st_size for f in part.iterdir()) < 54.1 * 2**20, part
    site, stage = tmp_path / "site", tmp_path / "stage"
    codes = [subprocess.run([sys.executable, str(REPO / "tools" / "gpu_wheels.py"), "install", str(part),
                             "--site", str(site), "--stage", str(stage)], timeout=600).returncode for part in parts]
    assert codes[-1] == 0 and set(codes[:-1]) <= {0, 3}, codes
    for name, entry in manifest["wheels"].items():  # what was installed is what was downloaded
        assert hashlib.sha256((stage / name).read_bytes()).hexdigest() == entry["sha256"], name
    assert (site / "flash_attn" / "cute" / "interface.py").exists()
    probe = subprocess.run(
        [sys.executable, "-c", "import deepspeed, hjson, pydantic, zstandard; print(deepspeed.__file__)"],
        env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().splitlines()[-1].startswith(str(site)), probe.stdout  # not the venv's copy


def test_kernel_register_budget(tmp_path):
    """Every kernel config the runtime picks first for sm_80 and sm_90a at head dim 64 and 128 (bf16; fp16 compiles
    to the same code), TAPE and values-only, and of the TAPE state-update kernels at the llama-1b and llama2-7b
    shapes: zero register spills, shared memory within the arch's limit."""
    pytest.importorskip("triton")
    from tapetrain.kernels.ptx_report import find_ptxas

    if not find_ptxas():
        pytest.skip("no ptxas in the triton wheel")
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "kernel_report.py"), "--dtypes", "bf16", "--out",
                           str(out)], capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})  # fmt: skip
    report = json.loads(out.read_text())
    records = report["records"]
    attention = [r for r in records if "head_dim" in r]
    assert {(r["arch"], r["head_dim"], r["case"]) for r in attention} == {
        (a, d, c) for a in ("sm_80", "sm_90a") for d in (64, 128) for c in ("tape", "plain")
    }
    assert {r["kernel"] for r in attention} >= {f"tape_attention.{k}" for k in ("_fwd_kernel", "_bwd_dq_kernel",
                                                                               "_bwd_dkdv_kernel")}  # fmt: skip
    # the TAPE state-update kernels (tools/kernel_report.py KERNEL_MODULES) at the llama-1b and llama2-7b shapes
    mlp = {(r["kernel"], r["arch"], r["shape"].split()[0]) for r in records if r["kernel"].startswith("tape_mlp")}
    assert mlp == {(f"tape_mlp_update.{k}", a, s) for k in ("_fwd_kernel", "_bwd_state_kernel", "_bwd_weight_kernel")
                   for a in ("sm_80", "sm_90a") for s in ("llama-1b", "llama2-7b")}  # fmt: skip
    for r in records:
        assert r["registers"] > 0
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, r
        assert r["shared_bytes"] <= r["shared_limit"], r
    assert proc.returncode == 0, proc.stdout[-2000:]


def run_check(report: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "kernel_report.py"), "--check", str(report)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)  # fmt: skip


def test_committed_kernel_report_lists_the_configs_the_runtime_chooses():
    """docs/benchmarks/kernel-report.json once listed 6 launch configs (sm_90a, D=128, dk/dv passes) the runtime no
    longer used; the check compares without ptxas, so it runs everywhere."""
    pytest.importorskip("triton")
    proc = run_check(REPO / "docs" / "benchmarks" / "kernel-report.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_kernel_report_check_names_a_config_that_changed(tmp_path):
    pytest.importorskip("triton")
    report = json.loads((REPO / "docs" / "benchmarks" / "kernel-report.json").read_text())
    dq = "tape_attention._bwd_dq_kernel"
    changed = next(r for r in report["records"] if r["chosen"] and r["kernel"] == dq and not r["candidate"])
    changed["config"]["num_warps"] = 2 if changed["config"]["num_warps"] != 2 else 4
    mlp = next(r for r in report["records"] if r["kernel"] == "tape_mlp_update._bwd_weight_kernel")
    mlp["config"]["BLOCK_I"] *= 2
    fwd = "tape_attention._fwd_kernel"
    report["records"] = [r for r in report["records"] if r["kernel"] != fwd or r["arch"] != "sm_80"]
    # a Hopper candidate dropped from the report: the search it records is no longer the runtime's
    candidate = next(r for r in report["records"] if r["candidate"] and not r["chosen"])
    report["records"].remove(candidate)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    proc = run_check(path)
    assert proc.returncode == 1
    assert f"{dq} {changed['arch']} {changed['dtype']} head_dim={changed['head_dim']} case={changed['case']}: " \
           f"report" in proc.stdout  # fmt: skip
    assert f"{fwd} sm_80 bf16 head_dim=64 case=tape: launched, missing from the report" in proc.stdout
    assert f"tape_mlp_update._bwd_weight_kernel {mlp['arch']} {mlp['dtype']} shape={mlp['shape']}: report" \
        in proc.stdout  # fmt: skip
    c = candidate["config"]
    missing = f"'{c['BLOCK_M']},{c['BLOCK_N']},{c['num_warps']},{c['num_stages']}'"
    assert f"{candidate['kernel']} sm_90a {candidate['dtype']} head_dim={candidate['head_dim']} case=tape: " \
           f"candidates differ (report only: []; runtime only: [{missing}])" in proc.stdout  # fmt: skip
    assert "is stale" in proc.stdout and "make kernel-report" in proc.stdout


def test_tuning_times_the_zero_spill_hopper_candidates_of_the_committed_report():
    """tools/tune_attention.py on Hopper times only the candidates the kernel report compiled without spills and
    within shared memory, in HOPPER_CANDIDATES' order; on another arch (no sm_90a figures apply) all of them."""
    pytest.importorskip("triton")
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from tune_attention import REPORT, as_tuple, candidates
    finally:
        sys.path.pop(0)
    from tapetrain.kernels.tape_attention import HOPPER_CANDIDATES, LAUNCH_NAMES

    records = json.loads(REPORT.read_text())["records"]
    for kind, d in (("fwd", 64), ("fwd", 128), ("dq", 128), ("dkdv", 64), ("dkdv", 128), ("de", 128)):
        every = [as_tuple(c.as_dict()) for c in HOPPER_CANDIDATES[kind]]
        timed = candidates(kind, 90, d, "bf16", REPORT)
        assert timed and timed == [c for c in every if c in timed]
        figures = {as_tuple(r["config"]): r for r in records if r["candidate"] and r["arch"] == "sm_90a"
                   and r["kernel"] == f"tape_attention.{LAUNCH_NAMES[kind]}" and r["head_dim"] == d
                   and r["dtype"] == "bf16"}  # fmt: skip
        assert set(figures) == set(every)
        for config in every:
            r = figures[config]
            fits = not (r["spill_store_bytes"] or r["spill_load_bytes"]) and r["shared_bytes"] <= r["shared_limit"]
            assert (config in timed) == fits, (kind, d, config)
        assert candidates(kind, 80, d, "bf16", REPORT) == every


def test_summary_rows_for_the_fused_updates_appear_when_that_stage_ran(tmp_path):
    """The fused stages' JSONs (model.tape_fused_updates=true) get their own rows; a campaign without them (every
    one before #35's kernels) gets none, not a 'not measured' row."""
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_summary

    out = REPO / "docs" / "benchmarks" / "gpu" / "h200-2026-11-27"
    assert not any("fused" in line for line in gpu_summary.target_lines(out))
    train = json.loads((out / "train-llama-1b-compile.json").read_text())
    (tmp_path / "train-llama-1b-compile.json").write_text(json.dumps(train))
    fused = {**train, "overrides": {**train["overrides"], "tape_fused_updates": True}, "tape_over_rope_step_time": 1.08,
             "attention_ran": {**train["attention_ran"], "tape_updates": ["fused"]}}
    (tmp_path / "train-llama-1b-compile-fused.json").write_text(json.dumps(fused))
    rows = [line for line in gpu_summary.target_lines(tmp_path) if "fused E updates" in line]
    assert len(rows) == 2, rows  # the step ratio and RoPE's MFU of that run
    assert "| 1.080× | ≤ 1.1× | yes | train-llama-1b-compile-fused.json |" in rows[0]


def test_a_rerun_replaces_the_results_of_the_tests_it_ran_again(tmp_path):
    """A later call that ran a campaign's failures again after a fix writes gpu-tests-rerun.xml: its outcomes replace
    those tests' earlier ones in summary.md, in --last-failed and in the kernel record (a path whose test failed,
    then passed on the rerun, is verified); tests it did not rerun keep their first result."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from gpu_summary import last_failed, test_lines
    finally:
        sys.path.pop(0)
    from tapetrain.bench.campaign_record import record_from_junit

    claim = '<properties><property name="verifies" value=\'{"kind": "attention", "backend": "triton", "e": true}\'/>' \
            '</properties>'  # fmt: skip
    case = '<testcase classname="tests.unit.test_a" name="test_{}" time="1">{}</testcase>'

    def suite(body: str) -> str:
        return f"<testsuites><testsuite>{body}</testsuite></testsuites>"

    out = tmp_path / "h200-2026-11-28"
    out.mkdir()
    first = case.format("fixed", claim + "<failure message='off'/>") + case.format("still", "<failure message='x'/>")
    (out / "gpu-tests.xml").write_text(suite(first + case.format("ok", "")))
    assert sorted(last_failed(tmp_path)) == ["tests/unit/test_a.py::test_fixed", "tests/unit/test_a.py::test_still"]
    (out / "gpu-tests-rerun.xml").write_text(suite(case.format("fixed", claim)))
    assert last_failed(tmp_path) == ["tests/unit/test_a.py::test_still"]
    lines, counts = test_lines(out)
    assert counts == {"passed": 2, "failed": 1, "skipped": 0}
    assert [line for line in lines if "test_fixed" in line] == ["| unit.test_a::test_fixed | passed | 1.0 s |"]
    record = record_from_junit(sorted(out.glob("gpu-tests*.xml")), device="H200", capability="9.0", date="2026-11-28",
                               versions={})  # fmt: skip
    assert [p["passed"] for p in record["paths"]] == [True]
