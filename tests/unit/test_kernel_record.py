"""`auto` picks only verified GPU paths: the record the campaign writes from its junit XML, auto's choice against a
record, the warning for a path named explicitly, and --print-config. No GPU here: the CUDA device's capability and
the installed packages are set per test (monkeypatch); the choice logic and the record are the real ones."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tapetrain.bench.campaign_record import add_timings, merge_campaign, record_from_junit
from tapetrain.errors import ConfigError
from tapetrain.model import attention, execution_plan, kernel_record, loss, preset_config
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


HEAD_DIM = preset_config("tiny").head_dim


def _timed(backend: str, ms: float, *, e: bool = True, docs: bool = False, gqa: bool = False) -> dict:
    """One bake-off row: `backend` exact and timed at `ms` (fwd+bwd) for the tiny preset's head dim."""
    return {"backend": backend, "e": e, "docs": docs, "gqa": gqa, "head_dim": HEAD_DIM, "seq_len": 8192,
            "exact": True, "fwd_bwd_ms": ms, "fwd_bwd_tflops": 100.0}


# The bake-off timed the Triton kernel faster than SDPA with E, with and without documents and GQA, and flash-attn
# fastest without E: what `auto` picks still depends on which of them passed their gpu tests (JUNIT above).
TIMED = [_timed("sdpa", 9.0, docs=d, gqa=g) for d in (False, True) for g in (False, True)] + \
        [_timed("triton", 7.0, docs=d, gqa=g) for d in (False, True) for g in (False, True)] + \
        [_timed("sdpa", 5.0, e=False), _timed("flash", 3.0, e=False)]  # fmt: skip


@pytest.fixture
def record(tmp_path, monkeypatch):
    """A campaign on sm_80 from the junit XML above, as the record `auto` reads."""
    xml = tmp_path / "gpu-tests.xml"
    xml.write_text(JUNIT)
    campaign = record_from_junit([xml], device="NVIDIA A100-SXM4-80GB", capability="8.0", date="2026-11-27",
                                 versions={"torch": "2.11.0"})
    campaign = add_timings(campaign, [{"dtype": dtype, "results": TIMED} for dtype in ("bf16", "fp16")])
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


def choose(requested: str, *, has_e: bool, has_docs: bool = False, gqa: bool = False, dtype=torch.bfloat16,
           pe: str = "tape") -> str:
    """The backend the execution plan gives the layers with (has_e) or without E, for calls with or without a
    document mask, on the fake CUDA device."""
    cfg = preset_config("tiny", pe=pe, n_layers=2, attn_backend=requested, n_kv_heads=2 if gqa else None)
    plan = execution_plan.resolve_plan(cfg, CUDA, dtype, documents=has_docs)
    (layer,) = [layer for layer in plan.layers if layer.carries_e == has_e][:1]
    return layer.attention.backend(has_docs, grad=True)


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
    assert choose("auto", has_e=True) == "triton"  # timed fastest, and passed its tests on sm_80
    assert choose("auto", has_e=False) == "sdpa"  # flash timed fastest but its tests never ran: not picked
    assert choose("auto", has_e=True, has_docs=True) == "sdpa"  # its docs test failed; flex unrun
    assert choose("auto", has_e=True, dtype=torch.float16) == "triton"
    assert choose("auto", has_e=True, gqa=True) == "sdpa"  # GQA was not part of what passed
    fake_gpu(monkeypatch, (9, 0), installed=("triton", "flash", "flex"))
    assert choose("auto", has_e=True) == "sdpa"  # sm_90 has no campaign in this record


def test_an_empty_record_leaves_auto_on_pytorch_kernels(tmp_path, monkeypatch):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"schema": 1, "campaigns": []}))
    monkeypatch.setenv(kernel_record.RECORD_ENV, str(empty))
    kernel_record.clear_cache()
    fake_gpu(monkeypatch, (8, 0), installed=("triton", "flash", "flex"))
    for has_e in (True, False):
        for docs in (True, False):
            assert choose("auto", has_e=has_e, has_docs=docs) == "sdpa"


def test_a_path_named_explicitly_runs_with_one_warning(record, monkeypatch, caplog):
    fake_gpu(monkeypatch, (8, 0), installed=("triton", "flash"))
    with caplog.at_level(logging.WARNING, logger="tapetrain.model"):
        for _ in range(3):
            assert choose("flash", has_e=False, pe="rope") == "flash"
        assert choose("triton", has_e=True) == "triton"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # flash once (three plans resolved); triton passed here with E, so only TAPE's last layer (no E) is unverified
    assert len(warnings) == 2, warnings
    assert "'flash'" in warnings[0] and "unverified" in warnings[0] and "make gpu-check" in warnings[0]
    assert "sm_80" in warnings[0]
    assert "'triton'" in warnings[1] and "with E" not in warnings[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tapetrain.model"):
        choose("triton", has_e=True, has_docs=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    (failed,) = [w for w in warnings if "with E, document mask" in w]
    assert "failed its tests in the campaign of 2026-11-27" in failed


def test_liger_only_when_verified(record, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(loss, "liger_available", lambda: True)
    assert loss.resolve_loss_backend("auto", CUDA, torch.bfloat16) == "liger"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert loss.resolve_loss_backend("auto", CUDA, torch.bfloat16) == "chunked"


def test_print_config_names_each_layer_kind_and_whether_it_is_verified(record, monkeypatch):
    fake_gpu(monkeypatch, (8, 0), installed=("triton", "flash"))
    cfg = preset_config("tiny", pe="tape", n_layers=3, n_kv_heads=None)
    lines = execution_plan.resolve_plan(cfg, CUDA, torch.bfloat16).lines()
    assert lines[0].startswith("attention ('auto' on fake sm_80, bf16")
    assert "layers carrying TAPE's E (0-1): triton (verified)" in lines[1]
    assert "layers without E (2): sdpa (PyTorch's own kernel (the fallback))" in lines[2]
    cfg = preset_config("tiny", pe="rope", n_layers=2, attn_backend="flash")
    (line,) = execution_plan.resolve_plan(cfg, CUDA, torch.bfloat16).lines()[1:]
    assert "flash (UNVERIFIED on this GPU; run `make gpu-check`" in line


def test_layers_without_the_attention_update_carry_no_e(record, monkeypatch):
    """model.tape_attn_update=false: layers still update E (the MLP side) but attend without it, so the plan (and
    --print-config) names the no-E path for them. Grouping layers by `updates_tape_state` named the with-E
    backend (triton, verified with E only) for layers whose attention never sees E."""
    fake_gpu(monkeypatch, (8, 0), installed=("triton",))
    cfg = preset_config("tiny", pe="tape", n_layers=3, tape_attn_update=False)
    plan = execution_plan.resolve_plan(cfg, CUDA, torch.bfloat16)
    assert [layer.carries_e for layer in plan.layers] == [False, False, False]
    lines = plan.lines()
    assert not any("carrying TAPE's E" in line for line in lines), lines
    assert "layers without E (0-2): sdpa" in lines[1]
    assert [cfg.carries_e(i) for i in range(3)] == [False, False, False]
    assert [preset_config("tiny", pe="tape", n_layers=3).carries_e(i) for i in range(3)] == [True, True, False]


def test_a_refused_setting_names_the_key_and_the_fix(monkeypatch):
    fake_gpu(monkeypatch, (8, 0), installed=())
    with pytest.raises(ConfigError, match=r"model.attn_backend=triton cannot run .* use model.attn_backend=auto"):
        execution_plan.resolve_plan(preset_config("tiny", pe="tape", attn_backend="triton"), CUDA, torch.bfloat16)
    fake_gpu(monkeypatch, (8, 0), installed=("flash",))
    with pytest.raises(ConfigError, match="does not take the additive bias of model.pe=alibi"):
        execution_plan.resolve_plan(preset_config("tiny", pe="alibi", attn_backend="flash"), CUDA, torch.bfloat16)


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
            backends = {"attention": ATTN_BACKENDS, "loss": LOSS_BACKENDS, "tape_update": ("triton", "eager")}
            assert path["backend"] in backends[path["kind"]] and path["dtype"] in ("bf16", "fp16", "fp32"), path
            assert path["tests"], path  # every verdict names the tests behind it


def test_a_forward_decides_nothing(monkeypatch):
    """The plan is resolved once; a forward and backward, eager or through a compiled layer, only read the names the
    modules were given (no record lookup, no resolution that torch.compile would have to trace)."""
    from tapetrain.model import tape_fused
    from tapetrain.model.transformer import Transformer

    cfg = preset_config("tiny", pe="tape", n_layers=2, max_seq_len=16)
    model = Transformer(cfg)
    model.use_plan(execution_plan.resolve_plan(cfg, torch.device("cpu"), torch.float32))

    def forbidden(*args, **kwargs):
        raise AssertionError("resolved during a forward")

    for owner, name in ((execution_plan, "resolve_plan"), (execution_plan, "_attention"), (tape_fused,
                        "resolve_fused_updates"), (loss, "resolve_loss_backend"), (kernel_record, "status")):
        monkeypatch.setattr(owner, name, forbidden)
    ids = torch.randint(0, cfg.vocab_size, (1, 17))
    model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
    positions = torch.arange(16.0, dtype=torch.float64)[None]  # (1, T)
    ctx = model.pe.context(positions, positions, torch.float32)
    explain = torch._dynamo.explain(model.layers[0])(model.embed(ids[:, :-1]), ctx, ctx.tape_init, model.pe)
    assert explain.graph_break_count == 0, explain.break_reasons
