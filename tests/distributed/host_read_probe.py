"""Run by test_sync_free_step.py in one process: counts the host reads (item, tolist, bool, float, int, cpu,
nonzero: each a device synchronisation on CUDA) made while the Trainer runs optimizer steps, split into those
made by tapetrain's training code and those made inside DeepSpeed/torch, for one gradient-accumulation setting.
The model's own forward is covered on the meta device (test_model_decoder: it reads nothing from a non-CPU
device); on CPU its token-id check reads host memory, which synchronises nothing, so it is not counted here.

    python tests/distributed/host_read_probe.py CONFIG.yaml OUT.json
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from torch.overrides import TorchFunctionMode

from tapetrain.config import load_run_config
from tapetrain.distributed import end_rank_process, init_distributed
from tapetrain.train.build import build_components
from tapetrain.train.trainer import Trainer

HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "cpu", "nonzero", "numpy"}
PACKAGE = str(Path(__import__("tapetrain").__file__).parent)
MODEL = str(Path(PACKAGE) / "model")


class CountHostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.ours: list[str] = []
        self.theirs = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            caller = traceback.extract_stack(limit=2)[0]  # the frame that asked for the value
            if caller.filename.startswith(MODEL):
                pass
            elif caller.filename.startswith(PACKAGE):
                self.ours.append(f"{Path(caller.filename).name}:{caller.lineno} {func.__name__}")
            else:
                self.theirs += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    config, out = sys.argv[1], Path(sys.argv[2])
    env = init_distributed()
    cfg = load_run_config(config).resolve(env.world_size, env.device.type)
    trainer = Trainer(cfg, env, build_components(cfg, env))
    trainer.train_step()  # warm-up: first-step allocations and lazy initialisation
    trainer.step += 1
    counter = CountHostReads()
    steps = 2
    with counter:
        for _ in range(steps):
            trainer.train_step()
            trainer.step += 1
    out.write_text(json.dumps({
        "grad_accum_steps": trainer.c.train_batches.grad_accum_steps,
        "ours_per_step": len(counter.ours) / steps,
        "ours": sorted(set(counter.ours)),
        "theirs_per_step": counter.theirs / steps,
    }))
    trainer.engine.destroy()


if __name__ == "__main__":
    main()
    end_rank_process(0)
