"""One rank of test_fused_loss_zero3 (started by the deepspeed launcher, 2 CPU ranks over gloo).

For tied and untied embeddings, builds a real ZeRO-3 engine (fp32, every parameter partitioned: persistence
threshold 0) with model.loss_backend=plain and one with chunked (several chunks per micro-batch; TAPE weights
random and non-zero), runs one micro-batch per rank with -100 labels (scattered, and a whole row on rank 1),
gathers every full gradient with safe_get_full_grad, takes one optimizer step and a second forward. Rank 0
writes the comparison as JSON.

    deepspeed --num_gpus 2 tests/distributed/fused_loss_zero3_worker.py OUT.json
"""

from __future__ import annotations

import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad

from tapetrain.config import RunConfig, build_deepspeed_config
from tapetrain.distributed import end_rank_process
from tapetrain.model import Transformer
from tapetrain.train.optim import build_optimizer

WORLD = 2
CHUNK_MIB = 10 * 512 * 4 / 2**20  # 10 tokens per chunk at V = 512: 7 chunks per rank's 64 tokens


def make_engine(tie: bool, backend: str):
    cfg = RunConfig.from_dict({
        "model": {"preset": "tiny", "pe": "tape", "tie_embeddings": tie, "loss_backend": backend,
                  "loss_chunk_mib": CHUNK_MIB},
        "data": {"train": "unused"},
        "train": {"steps": 2, "micro_batch_size": 2, "global_batch_size": 2 * WORLD},
        "optim": {"lr": 1e-2, "warmup_steps": 0, "schedule": "constant"},
        "deepspeed": {"zero_stage": 3, "precision": "fp32", "stage3_param_persistence_threshold": 0},
    }).resolve(WORLD, "cpu")  # fmt: skip
    torch.manual_seed(0)  # the same init on every rank and for both backends
    model = Transformer(cfg.model.model_config())
    with torch.no_grad():  # TAPE's W_A and W_down start at zero: make every TAPE update active
        for name, param in model.named_parameters():
            if "tape" in name:
                param.normal_(std=0.2)
    optimizer = build_optimizer(model, cfg.optim, cfg.train.trainable)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=build_deepspeed_config(cfg, WORLD))
    return engine


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(100 + rank))
    labels = tokens[:, 1:].clone()
    labels[:, ::4] = -100
    if rank == 1:
        labels[0] = -100  # a sequence with no target at all
    return tokens[:, :-1], labels


def run(tie: bool, backend: str) -> dict:
    engine = make_engine(tie, backend)
    head = engine.module.lm_head.weight
    partitioned = [head.ds_numel, head.ds_tensor.numel(), head.numel()]  # full size, this rank's part, resident
    inputs, labels = batch(dist.get_rank())
    out = engine(inputs, labels=labels)
    assert (out.logits is None) == (backend != "plain")
    engine.backward(out.loss)
    grads = {name: safe_get_full_grad(p).detach().clone() for name, p in engine.module.named_parameters()}
    engine.step()
    second = engine(inputs, labels=labels).loss
    losses = [float(out.loss), float(second)]
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, losses)
    engine.destroy()
    return {"losses": gathered, "grads": grads, "partitioned": partitioned}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().abs().max()
    diff = (actual.double() - expected.double()).abs().max()
    return float(diff / scale) if scale > 0 else (0.0 if diff == 0 else float("inf"))


def main() -> None:
    out_path = next(arg for arg in sys.argv[1:] if not arg.startswith("--local_rank"))
    from tapetrain.distributed import skip_cpu_shm_op_build

    skip_cpu_shm_op_build()  # no C++ build on CPU (see tapetrain.distributed)
    deepspeed.init_distributed(dist_backend="gloo")
    report = {}
    for tie in (False, True):
        plain, fused = run(tie, "plain"), run(tie, "chunked")
        report["tied" if tie else "untied"] = {
            "losses_plain": plain["losses"],
            "losses_fused": fused["losses"],
            "partitioned": [plain["partitioned"], fused["partitioned"]],
            "grad_rel_err": {name: rel_err(fused["grads"][name], g) for name, g in plain["grads"].items()},
            "grad_names": sorted(plain["grads"]),
        }
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
    end_rank_process(0)
