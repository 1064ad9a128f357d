"""`auto` picks only verified GPU paths: the record the campaign writes from its junit XML, auto's choice against a
record, the warning for a path named explicitly, and --print-config. No GPU here: the CUDA device's capability and
the installed packages are set per test (monkeypatch); the choice logic and the record are the real ones."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tapetrain.bench.campaign_record import merge_campaign, record_from_junit
from tapetrain.model import attention, kernel_record, loss
from tapetrain.model.attention import choose_backend
from tapetrain.model.config import ATTN_BACKENDS, LOSS_BACKENDS

CUDA = torch.device("cuda")

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.unit.test_k" name="test_triton_ok" time="1.0"><properties>
 <property name="verifies" value='{"kind": "attention", "backend": "triton", "dtypes": ["bf16", "fp16"], "e": true}'/>
</properties></testcase>
<testcase classname="tests.unit.test_k" name="test_triton_docs_ok" time="1.0"><properties>
 <property name="verifies" value='{"kind": "attention", "backend": "triton", "dtypes":["bf16"],"e":true,"docs":true}'/>
</properties></testcase>
<testcase classname="tests.unit.test_k" name="test_triton_docs_broken" time="1.0"><properties>
 <property name="verifies" value='{"kind": "attention", "backend": "triton", "dtypes":["bf16"],"e":true,"docs":true}'/>
</properties><failure message="AssertionError: off by 0.3">...</failure></testcase>
<testcase classname="tests.unit.test_k" name="test_flash" time="0.0"><properties>
 <property name="verifies" value='{"kind": "attention", "backend": "flash", "dtypes": ["bf16"]}'/>
</properties><skipped message="could not import flash_attn"/></testcase>
<testcase classname="tests.unit.test_l" name="test_liger" time="1.0"><properties>
 <property name="verifies" value='{"kind": "loss", "backend": "liger", "dtypes": ["bf16"]}'/>
</properties></testcase>
<testcase classname="tests.unit.test_k" name="test_unclaimed" time="1.0"/>
</testsuite></testsuites>"""


@pytest.fixture
def record(tmp_path, monkeypatch):
    """A campaign on sm_80 from the junit XML above, as the record `auto` reads."""
    xml = tmp_path / "gpu-tests.xml"
    xml.write_text(JUNIT)
    campaign = record_from_junit([xml], device="NVIDIA A100-SXM4-80GB", capability="8.0", date="2026-11-27",
                                 versions={"torch": "2.11.0"})
    path = tmp_path / "record.json"
    merge_campaign(path, campaign)
    monkeypatch.setenv(kernel_record.RECORD_ENV, str(path))
    kernel_record.clear_cache()
    yield path
    kernel_record.clear_cache()


def fake_gpu(monkeypatch, capability=(8, 0), installed=("triton",)):
    """A CUDA device of `capability` with `installed` backends (this machine has neither)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"fake sm_{capability[0]}{capability[1]}")
    monkeypatch.setattr(attention, "backend_available", lambda name, device: name in ("eager", "sdpa", *installed))
    monkeypatch.setattr(attention, "_cudnn_sdpa", lambda device: False)
    attention._logged_choices.clear()


def test_the_record_holds_passes_failures_and_never_skips(record):
    campaign = json.loads(record.read_text())["campaigns"][0]
    by_key = {(p["kind"], p["backend"], p["dtype"], p["docs"]): p for p in campaign["paths"]}
    assert by_key[("attention", "triton", "bf16", False)]["passed"]
    assert by_key[("attention", "triton", "fp16", False)]["passed"]  # one test, two dtypes
    docs = by_key[("attention", "triton", "bf16", True)]
    assert not docs["passed"]  # one of its two tests failed: the path is not verified
    assert any("test_triton_docs_broken: failed" in t for t in docs["tests"])
    assert ("attention", "flash", "bf16", False) not in by_key  # only skipped: no result either way
    assert by_key[("loss", "liger", "bf16", False)]["passed"]
    assert campaign["device"] == "NVIDIA A100-SXM4-80GB" and campaign["capability"] == "8.0"


def test_auto_picks_only_what_passed_on_this_capability(record, monkeypatch):
    fake_gpu(monkeypatch, (8, 0), installed=("triton", "flash", "flex"))
    pick = dict(device=CUDA, dtype=torch.bfloat16, has_bias=False)
    assert choose_backend("auto", has_e=True, **pick) == "triton"  # passed on sm_80
    assert choose_backend("auto", has_e=False, **pick) == "sdpa"  # flash installed but never ran: not picked
    assert choose_backend("auto", has_e=True, has_docs=True, **pick) == "sdpa"  # its docs test failed; flex unrun
    assert choose_backend("auto", has_e=True, dtype=torch.float16, device=CUDA, has_bias=False) == "triton"
    assert choose_backend("auto", has_e=True, gqa=True, **pick) == "sdpa"  # GQA was not part of what passed
    fake_gpu(monkeypatch, (9, 0), installed=("triton", "flash", "flex"))
    assert choose_backend("auto", has_e=True, **pick) == "sdpa"  # sm_90 has no campaign in this record


def test_an_empty_record_leaves_auto_on_pytorch_kernels(tmp_path, monkeypatch):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"schema": 1, "campaigns": []}))
    monkeypatch.setenv(kernel_record.RECORD_ENV, str(empty))
    kernel_record.clear_cache()
    fake_gpu(monkeypatch, (8, 0), installed=("triton", "flash", "flex"))
    for has_e in (True, False):
        for docs in (True, False):
            assert choose_backend("auto", device=CUDA, dtype=torch.bfloat16, has_bias=False, has_e=has_e,
                                  has_docs=docs) == "sdpa"


def test_a_path_named_explicitly_runs_with_one_warning(record, monkeypatch, caplog):
    fake_gpu(monkeypatch, (8, 0), installed=("triton", "flash"))
    with caplog.at_level(logging.WARNING, logger="tapetrain.model"):
        for _ in range(3):
            assert choose_backend("flash", device=CUDA, dtype=torch.bfloat16, has_bias=False, has_e=False) == "flash"
        assert choose_backend("triton", device=CUDA, dtype=torch.bfloat16, has_bias=False, has_e=True) == "triton"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # flash, once; triton passed here, so no warning
    assert "'flash'" in warnings[0] and "unverified" in warnings[0] and "make gpu-check" in warnings[0]
    assert "sm_80" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tapetrain.model"):
        choose_backend("triton", device=CUDA, dtype=torch.bfloat16, has_bias=False, has_e=True, has_docs=True)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "failed its tests in the campaign of 2026-11-27" in warning


def test_liger_only_when_verified(record, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(loss, "liger_available", lambda: True)
    assert loss.resolve_loss_backend("auto", CUDA, torch.bfloat16) == "liger"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert loss.resolve_loss_backend("auto", CUDA, torch.bfloat16) == "chunked"


def test_print_config_names_each_layer_kind_and_whether_it_is_verified(record, monkeypatch):
    from tapetrain.model import preset_config
    from tapetrain.train.preflight import attention_plan_lines

    fake_gpu(monkeypatch, (8, 0), installed=("triton", "flash"))
    cfg = preset_config("tiny", pe="tape", n_layers=3, n_kv_heads=None)
    lines = attention_plan_lines(cfg, "bf16", False, device=CUDA)
    assert lines[0].startswith("attention ('auto' on fake sm_80, bf16")
    assert "layers carrying TAPE's E (0-1): triton (verified)" in lines[1]
    assert "layers without E (2): sdpa (PyTorch's own kernel (the fallback))" in lines[2]
    cfg = preset_config("tiny", pe="rope", n_layers=2, attn_backend="flash")
    (line,) = attention_plan_lines(cfg, "bf16", False, device=CUDA)[1:]
    assert "flash (UNVERIFIED on this GPU; run `make gpu-check`" in line


def test_a_verifies_mark_reaches_the_junit_properties(request, verifies):
    """The mark (through the collection hook) and the fixture both become junit properties. The mark is added at run
    time, so the GPU campaign (`-m 'gpu or verifies'`) never selects this test: its claims would be false there."""
    from tests.conftest import pytest_collection_modifyitems

    request.node.add_marker(pytest.mark.verifies(kind="attention", backend="sdpa", dtypes=["fp32"]))
    pytest_collection_modifyitems(request.config, [request.node])
    verifies(kind="loss", backend="chunked", dtypes=["fp32"])
    claims = [json.loads(v) for k, v in request.node.user_properties if k == "verifies"]
    assert {"kind": "attention", "backend": "sdpa", "dtypes": ["fp32"]} in claims
    assert {"kind": "loss", "backend": "chunked", "dtypes": ["fp32"]} in claims


def test_the_committed_record_names_real_paths():
    record = json.loads(Path(kernel_record.RECORD_FILE).read_text())
    for campaign in record["campaigns"]:
        assert {"device", "capability", "date", "versions", "paths"} <= set(campaign)
        for path in campaign["paths"]:
            backends = ATTN_BACKENDS if path["kind"] == "attention" else LOSS_BACKENDS
            assert path["backend"] in backends and path["dtype"] in ("bf16", "fp16", "fp32"), path
            assert path["tests"], path  # every verdict names the tests behind it


def test_auto_decided_inside_a_compiled_layer_breaks_no_graph(record, monkeypatch):
    """The first attention call of a compiled layer resolves `auto` inside the compiled region; the record lookup
    (a file read) is a constant to torch.compile there, not a graph break, and it is the record's answer."""
    fake_gpu(monkeypatch, (8, 0), installed=("triton",))

    def step(x: torch.Tensor) -> torch.Tensor:
        name = choose_backend("auto", device=CUDA, dtype=torch.bfloat16, has_bias=False, has_e=True)
        return x * 2 if name == "triton" else x * 3

    explain = torch._dynamo.explain(step)(torch.ones(3))
    assert explain.graph_break_count == 0, explain.break_reasons
    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, backend="eager")(torch.ones(3)), torch.full((3,), 2.0))
