"""Without document ids the model computes what the code before document masking computed (661e90c^1, the first
parent of the issue-26 merge): the logits, loss and every gradient of a training step, for every encoding in eager
and sdpa, to float32 rounding. tests/unit/no_mask_reference.py says how the fixture was written: per tensor its norm
and 4 random projections, which any CPU reproduces to rounding (eager against sdpa differ by up to 3e-6 of a
tensor's norm, one thread against two by 3e-7) and any change of meaning moves by far more (one changed input token
moves the logits' by 0.2 of their norm, the loss by 2e-3: the last test). Computed in this process; no skip on any
CPU or torch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.unit.no_mask_reference import CASES, case_name, one_case, one_thread

FIXTURE = Path(__file__).parents[1] / "fixtures" / "no_mask_reference.json"
TOLERANCE = 1e-4  # of the tensor's norm: over 30x the eager/sdpa spread, 20x below a one-token change of the loss
# A gradient that is zero but for rounding (FIRE's last MLP bias: its output is shift-invariant after the softmax)
# is measured against this fraction of the step's whole gradient norm instead of its own (noise-sized) norm.
GRAD_FLOOR = 1e-3


def differences(got: dict, expected: dict) -> list[str]:
    """The tensors whose norm or any projection differs from the expected by more than the tolerance allows."""
    assert got.keys() == expected.keys()
    grad_norm = math.sqrt(sum(v["norm"] ** 2 for k, v in expected.items() if k.startswith("grad:")))
    out = []
    for name, exp in expected.items():
        scale = max(exp["norm"], GRAD_FLOOR * grad_norm) if name.startswith("grad:") else exp["norm"]
        values = zip([got[name]["norm"], *got[name]["proj"]], [exp["norm"], *exp["proj"]], strict=True)
        worst = max(abs(g - e) for g, e in values)
        if worst > TOLERANCE * scale:
            out.append(f"{name} (off by {worst / scale:.1e} of its scale)")
    return out


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads(FIXTURE.read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=[case_name(*c) for c in CASES])
def test_no_doc_ids_computes_what_the_base_commit_computed(case, expected):
    got = one_thread(one_case, *case)
    differ = differences(got, expected[case_name(*case)])
    assert not differ, f"not the base commit's step: {differ}"


def test_the_fixture_covers_every_case_and_tells_the_encodings_apart(expected):
    assert set(expected) == {case_name(*c) for c in CASES}
    for a in expected:
        for b in expected:
            if a.split("/")[0] != b.split("/")[0] or a.split("/")[2:] != b.split("/")[2:]:
                logits = [{"logits": expected[a]["logits"]}, {"logits": expected[b]["logits"]}]
                assert differences(*logits), (a, b)  # the logits tell them apart


def test_one_changed_input_token_is_noticed(expected):
    """The comparison's power: a different token at one position of one row (a far smaller change of meaning than
    a mask or encoding changed) moves the logits and the gradients far beyond the tolerance."""
    case = ("tape", "eager", {})
    differ = differences(one_thread(one_case, *case, change_input=True), expected[case_name(*case)])
    assert any(d.startswith("logits") for d in differ) and any(d.startswith("grad:") for d in differ), differ
