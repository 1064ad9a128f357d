"""model.tiled_mlp with sequence parallelism, on CPU ranks over gloo.

- A real DeepSpeed training (tape, ZeRO-2 and ZeRO-3) at SP 2 on 2 ranks with the tiled MLP gives the losses of
  1 rank without it (and so does 1 rank with it, ZeRO-2), within 1e-5 (fp32).
- The memory model's per-layer activation term (tapetrain.train.memory.layer_activation_bytes) against the bytes
  autograd saves in one layer on each rank, at SP 1 (this process) and SP 2 (2 ranks with the real Ulysses
  shard, sp_saved_bytes_worker.py), untiled and tiled, rope and tape: within 10%.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from harness import losses, script_launcher_cmd
from sp_saved_bytes_worker import BATCH, SEQ, config
from test_sequence_parallel import WORKER, base_config, run_worker

from tapetrain.model import Transformer
from tapetrain.train.memory import layer_activation_bytes, measure_layer_saved_bytes

pytestmark = pytest.mark.slow

CASE = ["model.pe=tape", "data.val=[]", "train.eval_interval=0"]
TILED = "model.tiled_mlp=3"  # 32 tokens per rank at SP 2: chunks of 11, 11 and 10


def cases(path: Path, config: Path, out: Path, runs: dict[str, list[str]]) -> Path:
    """A run_cases_worker.py cases file: one training per name, into out/name."""
    path.write_text(
        json.dumps(
            [
                {"config": str(config), "overrides": [f"run.out_dir={out / name}", *overrides]}
                for name, overrides in runs.items()
            ]
        )
    )
    return path


def test_tiled_mlp_at_sp2_reproduces_one_rank_untiled(tmp_path, shard_dir):
    """ZeRO-2 as asked, and ZeRO-3, whose module hooks gather the weights again in each chunk's recompute."""
    config = base_config(tmp_path, shard_dir, tmp_path)["lm"]
    stages = {f"z{z}": [*CASE, f"deepspeed.zero_stage={z}"] for z in (2, 3)}
    one = {**{f"plain-{z}": o for z, o in stages.items()}, "tiled-z2": [*stages["z2"], TILED]}
    two = {f"tiled-{z}": [*o, TILED, "parallel.sequence_parallel=2"] for z, o in stages.items()}
    run_worker([sys.executable, str(WORKER), str(cases(tmp_path / "one.json", config, tmp_path / "one", one))])
    run_worker(script_launcher_cmd(WORKER, 2, str(cases(tmp_path / "two.json", config, tmp_path / "two", two))))
    for z in stages:
        reference = losses(tmp_path / "one" / f"plain-{z}")
        assert len(reference) >= 2
        others = [tmp_path / "two" / f"tiled-{z}"] + ([tmp_path / "one" / "tiled-z2"] if z == "z2" else [])
        for other in others:
            got = losses(other)
            assert got.keys() == reference.keys(), (other, got)
            assert max(abs(got[s] - reference[s]) for s in reference) <= 1e-5, (other, got, reference)


def test_layer_activation_model_matches_saved_bytes_at_sp1_and_sp2(tmp_path):
    out = tmp_path / "saved.json"
    worker = Path(__file__).with_name("sp_saved_bytes_worker.py")
    run_worker(script_launcher_cmd(worker, 2, str(out)), timeout=600)
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
