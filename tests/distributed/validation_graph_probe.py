"""Run by test_sync_free_step.py in one process: builds the Trainer and runs Trainer.validate() while counting the
tensors autograd saves for a backward pass (each one a piece of a graph that validation never uses).

    python tests/distributed/validation_graph_probe.py CONFIG.yaml OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tapetrain.config import load_run_config
from tapetrain.distributed import end_rank_process, init_distributed
from tapetrain.train.build import build_components
from tapetrain.train.trainer import Trainer


def main() -> None:
    config, out = sys.argv[1], Path(sys.argv[2])
    env = init_distributed()
    cfg = load_run_config(config).resolve(env.world_size, env.device.type)
    trainer = Trainer(cfg, env, build_components(cfg, env))
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = trainer.validate()
    out.write_text(json.dumps({"saved_for_backward": saved, "val_loss": result["val_loss"],
                               "training_mode": trainer.engine.module.training}))
    trainer.engine.destroy()


if __name__ == "__main__":
    main()
    end_rank_process(0)
