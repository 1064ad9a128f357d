"""Claims about GPU runs stay tied to the committed JSON: the memory model against every committed GPU layer
measurement (within the bound the docs state), and the generated tables in docs/performance.md equal what the JSON
gives today. A change to the memory model or to a JSON that breaks a published claim fails here, on CPU."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "docs" / "benchmarks" / "gpu"
sys.path.insert(0, str(REPO / "tools"))
import gpu_summary  # noqa: E402

sys.path.pop(0)


def _generated_blocks(text: str) -> dict[str, str]:
    pattern = re.compile(r"<!-- generated: (.+?) -->\n(.*?)\n<!-- end generated -->", re.S)
    return {m.group(1).strip(): m.group(2).strip() for m in pattern.finditer(text)}


@pytest.mark.parametrize("path", sorted(GPU.glob("*/layer-*.json")), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_memory_model_within_its_bound_of_every_gpu_measurement(path: Path):
    data = json.loads(path.read_text())
    measured = data["per_layer_measured_gb"]["saved_bytes"]
    estimate = gpu_summary.layer_estimate_gib(data)
    assert measured > 0 and estimate > 0
    assert abs(measured / estimate - 1) <= gpu_summary.MEMORY_MODEL_BOUND, (path.name, measured, estimate)


def test_performance_doc_tables_are_generated_from_the_json(monkeypatch):
    monkeypatch.chdir(REPO)
    blocks = _generated_blocks((REPO / "docs" / "performance.md").read_text())
    assert set(blocks) == {"tools/gpu_summary.py --memory-model",
                           "tools/gpu_summary.py docs/benchmarks/gpu/h200-2026-11-28 --targets-only"}
    assert blocks["tools/gpu_summary.py --memory-model"] == "\n".join(gpu_summary.memory_model_lines())
    targets = gpu_summary.target_lines(GPU / "h200-2026-11-28")
    assert blocks["tools/gpu_summary.py docs/benchmarks/gpu/h200-2026-11-28 --targets-only"] == "\n".join(targets)
    assert "not measured" not in blocks["tools/gpu_summary.py docs/benchmarks/gpu/h200-2026-11-28 --targets-only"]
