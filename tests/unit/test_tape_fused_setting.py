"""model.tape_fused_updates (auto | true | false): what it resolves to against the kernel record, the
refusal of `true` where the kernels cannot run, the warning on an unverified GPU, and --print-config's line. No GPU
here: the CUDA device's capability is set per test (monkeypatch); the record and the choice logic are the real ones.
The kernels themselves are tested in tests/unit/test_kernel_tape_*.py and, end to end in a model, in
tests/unit/test_tape_fused_model.py."""

from __future__ import annotations

import logging

import pytest
import torch

from tapetrain.bench.campaign_record import merge_campaign, record_from_junit
from tapetrain.errors import ConfigError
from tapetrain.model import kernel_record, preset_config, tape_fused
from tapetrain.model.execution_plan import resolve_plan

CUDA, CPU = torch.device("cuda"), torch.device("cpu")

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.unit.test_kernel_tape_mlp_update" name="test_bf16" time="1.0"><properties>
 <property name="verifies" value='{"kind": "tape_update", "backend": "triton", "dtypes": ["bf16"]}'/>
</properties></testcase>
<testcase classname="tests.unit.test_kernel_tape_rotation" name="test_bf16" time="1.0"><properties>
 <property name="verifies" value='{"kind": "tape_update", "backend": "triton", "dtypes": ["bf16"]}'/>
</properties></testcase>
</testsuite></testsuites>"""


@pytest.fixture
def record(tmp_path, monkeypatch):
    """A campaign on sm_90 in which the fused updates passed in bf16 (and nothing else was tested)."""
    xml = tmp_path / "gpu-tests.xml"
    xml.write_text(JUNIT)
    campaign = record_from_junit([xml], device="NVIDIA H100 80GB HBM3", capability="9.0", date="2026-11-27",
                                 versions={"torch": "2.11.0"})
    merge_campaign(tmp_path / "record.json", campaign)
    monkeypatch.setenv(kernel_record.RECORD_ENV, str(tmp_path / "record.json"))
    kernel_record.clear_cache()
    yield
    kernel_record.clear_cache()


def fake_gpu(monkeypatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"fake sm_{capability[0]}{capability[1]}")
    monkeypatch.setattr(tape_fused, "triton_installed", lambda: True)


def fused(setting, device, dtype) -> bool:
    """What the execution plan decides for model.tape_fused_updates=`setting` (every layer of a TAPE model)."""
    plan = resolve_plan(preset_config("tiny", pe="tape", tape_fused_updates=setting), device, dtype)
    (decided,) = {layer.fused_updates for layer in plan.layers}
    return decided


def plan_lines(setting, dtype, device, pe="tape") -> list[str]:
    return resolve_plan(preset_config("tiny", pe=pe, tape_fused_updates=setting), device, dtype).lines()


def test_auto_is_fused_only_where_the_record_says_the_kernels_passed(record, monkeypatch):
    fake_gpu(monkeypatch, (9, 0))
    assert fused("auto", CUDA, torch.bfloat16)
    assert not fused("auto", CUDA, torch.float16)  # never tested in fp16
    fake_gpu(monkeypatch, (8, 0))  # an A100: no campaign
    assert not fused("auto", CUDA, torch.bfloat16)
    assert not fused(False, CUDA, torch.bfloat16)


def test_auto_is_eager_on_cpu_even_with_the_interpreter(record, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fused("auto", CPU, torch.float32)


def test_true_on_an_unverified_gpu_runs_with_one_warning(record, monkeypatch, caplog):
    fake_gpu(monkeypatch, (8, 0))
    kernel_record._warned.clear()
    with caplog.at_level(logging.WARNING, logger="tapetrain.model"):
        assert fused(True, CUDA, torch.bfloat16)
        assert fused(True, CUDA, torch.bfloat16)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "tape_update backend 'triton' on sm_80 bf16 is unverified" in warnings[0]
    assert "make gpu-check" in warnings[0]


def test_true_on_cpu_needs_the_interpreter_and_says_so(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"model.tape_fused_updates=true cannot run on this cpu machine.*"
                                          r"TRITON_INTERPRET=1.*model.tape_fused_updates=auto"):
        fused(True, CPU, torch.float32)
    assert not fused("auto", CPU, torch.float32)  # auto: nothing to refuse
    rope = resolve_plan(preset_config("tiny", pe="rope", tape_fused_updates=True), CPU, torch.float32)
    assert not rope.fused_updates  # no TAPE: nothing runs
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused(True, CPU, torch.float32)


def test_print_config_says_which_path_and_whether_it_is_verified(record, monkeypatch):
    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr("tapetrain.model.attention.backend_available", lambda name, device: name in ("eager", "sdpa"))
    line = plan_lines("auto", torch.bfloat16, CUDA)[-1]
    assert line == "TAPE's E updates (model.tape_fused_updates=auto on fake sm_90): fused Triton kernels (verified)"
    fake_gpu(monkeypatch, (8, 0))
    line = plan_lines("auto", torch.bfloat16, CUDA)[-1]
    assert line.endswith("eager (auto: not verified on this GPU)")
    line = plan_lines(True, torch.bfloat16, CUDA)[-1]
    assert "fused Triton kernels (UNVERIFIED on this GPU; run `make gpu-check`" in line
    line = plan_lines("auto", torch.float32, CPU)[-1]
    assert line == "TAPE's E updates (model.tape_fused_updates=auto on cpu): eager (auto: eager on cpu)"
    assert not any("E updates" in x for x in plan_lines("auto", torch.float32, CPU, pe="rope"))


def test_the_setting_changes_how_not_what_so_a_resume_may_change_it():
    from tapetrain.train.resume_checks import EXECUTION_ONLY_MODEL_FIELDS

    assert "tape_fused_updates" in EXECUTION_ONLY_MODEL_FIELDS


def test_loading_the_model_does_not_import_the_compiler():
    """Nothing the model does at import or build time needs torch._dynamo (about 1 s of every process that loads
    the model): the execution plan is plain data, resolved outside any compiled region."""
    import subprocess
    import sys

    code = "import sys, tapetrain.model; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
