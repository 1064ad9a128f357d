"""The table `attn_backend: auto` ranks attention paths by (kernel_record.fastest_attention): the bake-off's timings
in a campaign record, on synthetic records (TAPETRAIN_KERNEL_RECORD); the choice logic and the record are real."""

from __future__ import annotations

import json

import pytest

from tapetrain.bench.campaign_record import add_timings, merge_campaign, timings_from_bakeoff
from tapetrain.model import kernel_record
from tapetrain.model.kernel_record import fastest_attention

ALL = ["sdpa", "triton", "fa4", "fa4_wide", "fa4_wide_fwd", "fa4_padded"]


def _row(backend, ms, *, seq_len=8192, head_dim=128, e=True, docs=False, gqa=False, exact=True, error=None):
    row = {"backend": backend, "pe": "tape" if e else "rope", "e": e, "docs": docs, "gqa": gqa, "head_dim": head_dim,
           "seq_len": seq_len, "exact": exact, "fwd_bwd_ms": ms, "fwd_bwd_tflops": ms and 1000 / ms}
    return row if error is None else {**row, "error": error, "fwd_bwd_ms": None}


def _campaign(date, rows, *, passed=None, failed=(), capability="9.0", docs=False):
    """A campaign whose gpu tests passed for `passed` (default: every backend in `rows`) and failed for `failed`."""
    names = {r["backend"] for r in rows} if passed is None else set(passed)
    paths = [{"kind": "attention", "backend": b, "dtype": "bf16", "e": e, "docs": docs, "gqa": False,
              "passed": b not in failed, "tests": []}
             for b in sorted(names | set(failed)) for e in (True, False)]
    campaign = {"device": f"H-{date}", "capability": capability, "date": date, "versions": {}, "source": "",
                "paths": paths}
    return add_timings(campaign, [{"dtype": "bf16", "results": rows}])


@pytest.fixture
def record_of(tmp_path, monkeypatch):
    def write(*campaigns):
        path = tmp_path / "record.json"
        path.unlink(missing_ok=True)
        for c in campaigns:
            merge_campaign(path, c)
        monkeypatch.setenv(kernel_record.RECORD_ENV, str(path))
        kernel_record.clear_cache()
        return path

    yield write
    kernel_record.clear_cache()


def ask(candidates=ALL, **kw):
    key = {"capability": "9.0", "dtype": "bf16", "head_dim": 128, "e": True, "docs": False, "gqa": False, **kw}
    return fastest_attention(key.pop("capability"), key.pop("dtype"), key.pop("head_dim"), key.pop("e"),
                             key.pop("docs"), key.pop("gqa"), candidates)


def test_the_fastest_exact_verified_candidate_wins(record_of):
    record_of(_campaign("2026-12-01", [_row("sdpa", 8.8), _row("fa4_wide", 5.0), _row("fa4", 6.1),
                                       _row("fa4_padded", 4.0, exact=False),  # fastest, but not exact
                                       _row("fa4_wide_fwd", None, error="OutOfResources: smem")],
                        failed=["triton"]))
    assert ask() == "fa4_wide"
    assert ask(["sdpa", "fa4"]) == "fa4"  # only among the candidates given
    assert ask(["fa4_padded", "fa4_wide_fwd", "triton"]) is None  # inexact, failed to run, failed its tests


def test_a_path_whose_tests_failed_is_not_picked_however_fast(record_of):
    record_of(_campaign("2026-12-01", [_row("sdpa", 8.8), _row("fa4_wide", 5.0), _row("fa4", 6.0)], passed=[],
                        failed=["fa4_wide"]))
    assert ask() == "sdpa"  # fa4 has no gpu test result at all; SDPA, PyTorch's own, needs only the bake-off's check


def test_each_key_has_its_own_winner(record_of):
    rows = [_row("sdpa", 8.8), _row("fa4_wide", 5.0),
            _row("sdpa", 3.0, head_dim=64), _row("fa4_wide", 3.5, head_dim=64),
            _row("fa4", 3.9, e=False), _row("sdpa", 4.2, e=False),
            _row("triton", 4.0, docs=True), _row("fa4_wide", 6.0, docs=True)]
    campaign = _campaign("2026-12-01", rows)
    for p in list(campaign["paths"]):  # the docs paths verified too
        campaign["paths"].append({**p, "docs": True})
    record_of(campaign)
    assert ask() == "fa4_wide"
    assert ask(head_dim=64) == "sdpa"
    assert ask(e=False) == "fa4"
    assert ask(docs=True) == "triton"
    assert ask(gqa=True) is None and ask(dtype="fp16") is None and ask(head_dim=256) is None
    assert ask(capability="10.0") is None  # nothing timed on that kind of GPU


def test_the_newest_campaign_on_the_capability_decides(record_of):
    old = _campaign("2026-12-01", [_row("sdpa", 8.8), _row("fa4_wide", 5.0)])
    new = _campaign("2026-12-05", [_row("sdpa", 8.8), _row("fa4_wide", 9.5)])  # e.g. a new driver
    other = _campaign("2026-12-09", [_row("fa4_padded", 1.0)], capability="10.0")
    record_of(old, new, other)
    assert ask() == "sdpa"
    assert ask(capability="10.0") == "fa4_padded"


def test_candidates_are_compared_on_the_lengths_all_were_timed_at(record_of):
    rows = [_row("sdpa", 2.0, seq_len=2048), _row("sdpa", 9.0), _row("fa4_wide", 8.0),  # fa4_wide not at 2048
            _row("fa4", 1.0, seq_len=2048)]  # fa4 only at 2048: the longest length decides without it
    record_of(_campaign("2026-12-01", rows))
    assert ask() == "fa4_wide"
    assert ask(["sdpa", "fa4"]) == "fa4"  # common length 2048
    rows = [_row("sdpa", 2.0, seq_len=2048), _row("sdpa", 9.0), _row("fa4", 1.5, seq_len=2048), _row("fa4", 9.2)]
    record_of(_campaign("2026-12-01", rows))
    assert ask(["sdpa", "fa4"]) == "fa4"  # 10.7 ms over both lengths against 11.0, though slower at 8192


def test_the_tool_adds_a_follow_up_calls_timings_and_shows_them(tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))
    try:
        import kernel_record as tool
    finally:
        sys.path.pop(0)
    first = _campaign("2026-12-01", [_row("sdpa", 8.8), _row("fa4_wide", None, error="RuntimeError: boom")])
    path = tmp_path / "kernel-record.json"
    path.write_text(json.dumps(first))
    follow_up = tmp_path / "bakeoff-2.json"
    follow_up.write_text(json.dumps({"dtype": "bf16", "results": [_row("fa4_wide", 5.0), _row("fa4", 7.0)]}))
    assert tool.main(["add-timings", str(path), str(follow_up)]) == 0
    timings = {t["backend"]: t for t in json.loads(path.read_text())["timings"]}
    assert timings["fa4_wide"]["exact"] and timings["fa4_wide"]["fwd_bwd_ms"] == 5.0  # replaced the failed one
    assert set(timings) == {"sdpa", "fa4_wide", "fa4"}
    assert timings_from_bakeoff({"dtype": "bf16", "results": [_row("x", None, error="E")]})[0]["exact"] is False
