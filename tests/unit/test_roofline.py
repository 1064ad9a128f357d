"""The roofline of TAPE's own ops (tapetrain/bench/roofline.py): the byte counter counts what aten reads and writes,
eager's MLP-side update moves the ~18+ E-sized tensors the design review counted, and the committed JSON is what the
tool computes today."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tapetrain.bench.roofline import ByteCounter, layer_traffic, roofline
from tapetrain.model import preset_config

REPO = Path(__file__).resolve().parents[2]


def test_the_counter_counts_reads_and_writes_but_not_views():
    a = torch.empty(4, 8, device="meta")
    b = torch.empty(4, 8, device="meta")
    with ByteCounter() as counter:
        c = (a + b).view(8, 4).transpose(0, 1)
    assert c.shape == (4, 8)
    assert counter.read == 2 * 4 * 8 * 4 and counter.written == 4 * 8 * 4  # the add alone


def test_eager_moves_many_e_sized_tensors_and_fusing_removes_most():
    cfg = preset_config("llama-1b", pe="tape", max_seq_len=256)
    e = 2 * 256 * cfg.n_heads * cfg.head_dim * 2
    ops = {op.name: op for op in layer_traffic(cfg, 2, 256)}
    mlp = ops["mlp_update"]
    assert mlp.eager_fwd >= 18 * e  # up = W_up·E (4E), up * gate (4E in, 4E out), W_down· (4E in), the residual...
    for op in ops.values():
        assert op.fused_fwd + op.fused_bwd <= (op.eager_fwd + op.eager_bwd) / 4, op


def test_the_committed_roofline_is_current():
    committed = json.loads((REPO / "docs" / "benchmarks" / "tape-roofline.json").read_text())
    assert [r["preset"] for r in committed["results"]] == ["llama-1b", "llama2-7b"]
    fresh = roofline("llama-1b", 8, 2048)
    assert committed["results"][0]["ops"] == fresh["ops"]
    assert committed["results"][0]["step_bytes"] == fresh["step_bytes"]
