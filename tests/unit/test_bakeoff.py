"""The attention bake-off (tools/benchmark.py bakeoff) on the CPU at toy sizes: exactness before timing, an inexact
candidate never timed, the budget leaving groups for a follow-up call, and its JSON becoming the record's timings.
flash-attn-4's calls are the plain-torch reference of their contract (tests/unit/fa4_contract.py): this checks the
bake-off's logic, not the kernel."""

from __future__ import annotations

import itertools

import pytest
import torch

from tapetrain.bench import bakeoff
from tapetrain.bench.campaign_record import timings_from_bakeoff
from tapetrain.kernels import flash4
from tapetrain.model import attention as attn
from tests.unit.fa4_contract import ReferenceFa4Calls

TOY = {"d_model": 32, "tokens": 64, "rounds": 2, "warmup": 0, "device": "cpu"}


@pytest.fixture
def fa4_here(monkeypatch):
    """The flash-attn-4 backends count as installed, on the contract's reference."""
    real = bakeoff.backend_available
    monkeypatch.setattr(bakeoff, "backend_available",
                        lambda name, device: name in attn.FA4_BACKENDS or real(name, device))
    with flash4.using_calls(ReferenceFa4Calls()):
        yield


def test_exact_candidates_are_timed_and_an_inexact_one_is_not(fa4_here, monkeypatch):
    def off_by_a_little(q, k, v, e=None, **kw):
        out, out_e = attn.eager_attention(q, k, v, e, causal=True, docs=kw.get("docs"))
        return out * 1.05, out_e

    monkeypatch.setitem(attn._IMPLS, "fa4_padded", off_by_a_little)
    candidates = ["sdpa", "fa4", "fa4_wide_fwd", "fa4_padded"]
    s = bakeoff.BakeoffSettings(groups=[bakeoff.Group(16, 32, True)], candidates=candidates, **TOY)
    result = bakeoff.run_bakeoff(s, progress=False)
    rows = {(r["pe"], r["backend"]): r for r in result["results"]}
    assert set(rows) == {("tape", b) for b in candidates} | {("rope", "sdpa"), ("rope", "fa4")}
    for key, row in rows.items():
        if key == ("tape", "fa4_padded"):
            assert not row["exact"] and "fwd_bwd_ms" not in row and row["max_rel_err"][0] > 0.04
        else:
            assert row["exact"], row
            assert row["fwd_bwd_ms"] > 0 and row["fwd_bwd_tflops"] > 0 and len(row["max_rel_err"]) == len(
                row["tolerance"]) == (6 if key[0] == "tape" else 4)  # outputs, then every gradient
    timings = {t["backend"]: t for t in timings_from_bakeoff(result) if t["e"]}
    assert not timings["fa4_padded"]["exact"] and timings["fa4_wide_fwd"]["exact"] and timings["fa4_wide_fwd"]["docs"]
    assert "fa4 padded" not in bakeoff.bakeoff_report(result) and "NO" in bakeoff.bakeoff_report(result)


def test_the_budget_leaves_groups_for_a_follow_up_call():
    ticks = itertools.count(0, 100)  # every clock read is 100 s later
    groups = bakeoff.default_groups([16, 8], [32, 16])
    assert [g.name for g in groups[:2]] == ["16:32:plain", "16:32:docs"]  # the largest D and T first
    s = bakeoff.BakeoffSettings(groups=groups, candidates=["sdpa"], budget_s=150, clock=lambda: next(ticks), **TOY)
    result = bakeoff.run_bakeoff(s, progress=False)
    assert result["groups_done"] == ["16:32:plain"]
    assert result["groups_left"] == [g.name for g in groups[1:]]
    assert "--groups 16:32:docs,16:16:plain" in result["follow_up"]
    args = bakeoff.Group.parse("16:32:docs")
    assert args == bakeoff.Group(16, 32, True)


def test_settings_are_refused_in_the_users_words():
    with pytest.raises(ValueError, match="--dtype fp32"):
        bakeoff.check_settings(bakeoff.BakeoffSettings(groups=[], dtype="fp32"))
    with pytest.raises(ValueError, match="--candidates: unknown nope"):
        bakeoff.check_settings(bakeoff.BakeoffSettings(groups=[], candidates=["nope"]))
    with pytest.raises(ValueError, match="--kv-heads-ratio 3"):
        bakeoff.check_settings(bakeoff.BakeoffSettings(groups=[bakeoff.Group(64, 2048, False)], kv_heads_ratio=3))


def test_document_ids_are_uneven_and_the_pairs_counted_per_document():
    ids = bakeoff.document_ids(2, 64)
    assert torch.unique_consecutive(ids[0], return_counts=True)[1].tolist() == [32, 16, 8, 8]
    assert torch.unique_consecutive(ids[1], return_counts=True)[1].tolist() == [33, 16, 8, 7]
    docs = attn.DocumentMask.of(ids)
    assert bakeoff.attended_pairs(2, 3, 64, None) == 2 * 3 * 64 * 65 / 2
    assert bakeoff.attended_pairs(1, 3, 64, attn.DocumentMask.of(ids[:1])) == 3 * (32 * 33 + 16 * 17 + 8 * 9 * 2) / 2
    assert bakeoff.attended_pairs(2, 1, 64, docs) < bakeoff.attended_pairs(2, 1, 64, None)
