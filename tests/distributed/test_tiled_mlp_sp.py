"""model.tiled_mlp with sequence parallelism, on CPU ranks over gloo. (Trainings with the tiled MLP at SP 2 against
1 rank without it: test_sequence_parallel.py's shared launches.)

The memory model's per-layer activation term (tapetrain.train.memory.layer_activation_bytes) against the bytes
autograd saves in one layer on each rank, at SP 1 (this process) and SP 2 (2 ranks with the real Ulysses shard,
sp_saved_bytes_worker.py), untiled and tiled, rope and tape: within 1%.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import run, script_launcher_cmd
from sp_saved_bytes_worker import BATCH, SEQ, config

from tapetrain.model import Transformer
from tapetrain.train.memory import layer_activation_bytes, measure_layer_saved_bytes

pytestmark = pytest.mark.slow


def test_layer_activation_model_matches_saved_bytes_at_sp1_and_sp2(tmp_path):
    out = tmp_path / "saved.json"
    worker = Path(__file__).with_name("sp_saved_bytes_worker.py")
    run(script_launcher_cmd(worker, 2, str(out)), timeout=600)
    two = json.loads(out.read_text())
    ids = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    for pe in ("rope", "tape"):
        for tiled in (0, 4):
            cfg = config(pe, tiled)
            torch.manual_seed(0)
            one = measure_layer_saved_bytes(Transformer(cfg), ids)
            assert two[pe][str(tiled)][0] == two[pe][str(tiled)][1]  # both ranks hold the same shapes
            for n, measured in ((1, one), (2, two[pe][str(tiled)][0])):
                # CPU SDPA takes its math path for TAPE's [V ‖ E] values and keeps the softmax weights
                predicted = layer_activation_bytes(
                    cfg, BATCH, SEQ, 4, tiled_mlp=tiled, sequence_parallel=n, attention_matrix=pe == "tape",
                    first_layer=True,  # the worker measures layer 0, whose E^(0) needs no gradient
                )
                assert abs(predicted / measured - 1) <= 0.01, (pe, tiled, n, predicted, measured)
