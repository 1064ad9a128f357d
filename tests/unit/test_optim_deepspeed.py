"""Our DeepSpeed JSON + client AdamW + LambdaLR through a real `deepspeed.initialize` (1 CPU rank, gloo).

Runs in a subprocess so that the process group does not leak into other tests.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, os, socket, sys
    held = socket.socket()  # bound (SO_REUSEADDR, not listening) until the rendezvous listens: no other pick gets it
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    import torch, deepspeed
    from tapetrain.config import RunConfig, build_deepspeed_config
    from tapetrain.model import Transformer
    from tapetrain.train.optim import build_optimizer
    from tapetrain.train.schedule import build_scheduler, lr_at

    stage, offload, trainable = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
    cfg = RunConfig.from_dict({
        "model": {"preset": "tiny"}, "data": {"train": "unused"},
        "train": {"steps": 6, "micro_batch_size": 2, "global_batch_size": 4, "trainable": trainable},
        "optim": {"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, "schedule": "linear"},
        "deepspeed": {"zero_stage": stage, "precision": "fp32", "offload_optimizer": offload,
                      "offload_params": offload and stage == 3},
    }).resolve(1, "cpu")
    from tapetrain.distributed import skip_cpu_shm_op_build

    skip_cpu_shm_op_build()  # no C++ build on CPU (see tapetrain.distributed)
    deepspeed.init_distributed(dist_backend="gloo")
    held.close()
    torch.manual_seed(0)
    model = Transformer(cfg.model.model_config())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, cfg.optim, cfg.train.trainable)
    sched = build_scheduler(opt, cfg.optim, cfg.train.steps)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                           config=build_deepspeed_config(cfg, 1))
    lrs, losses = [], []
    for step in range(3):
        lrs.append(engine.get_lr()[0])
        for _ in range(engine.gradient_accumulation_steps()):
            x = torch.randint(0, cfg.model.vocab_size, (2, 16))
            loss = engine(x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    changed = {}
    if stage < 3:
        changed = {n: not torch.equal(p.detach(), before[n]) for n, p in engine.module.named_parameters()}
    print("RESULT" + json.dumps({"lrs": lrs, "expected": [lr_at(s, cfg.optim, 6) for s in range(3)],
                                 "losses": losses, "accum": engine.gradient_accumulation_steps(),
                                 "changed": changed}))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("stage, offload, trainable", [(2, False, "tape"), (3, True, "all")])
def test_deepspeed_initialize_with_our_optimizer_and_schedule(stage, offload, trainable):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(stage), str(int(offload)), trainable],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT") :])
    assert out["accum"] == 2
    assert out["lrs"] == pytest.approx(out["expected"], rel=1e-9)
    assert all(math.isfinite(loss) for loss in out["losses"])
    if trainable == "tape":  # frozen parameters stay put; TAPE parameters move
        assert out["changed"] and all(changed == ("tape" in name) for name, changed in out["changed"].items())
