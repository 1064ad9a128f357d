"""Run by test_safe_runs.py under `deepspeed --num_gpus 2`: real components and Trainer for each ZeRO stage given,
non-finite values injected on rank 1 only, and a record of what changed. Writes OUT/rank{R}.json.

    deepspeed --num_gpus 2 tests/distributed/step_guard_probe.py CONFIG.yaml OUT_DIR 0,2,3

Per stage: one normal step (so Adam's moments are non-zero: an AdamW step on zero gradients would still move the
weights), then a step whose gradients are inf/NaN while the loss stays finite (an identity in the forward pass
whose backward multiplies by inf), then a step whose loss is NaN, each compared bit for bit with the state before
it; then a normal step (which must change the weights again); then on_nan=stop on a non-finite gradient; then a
non-finite weight, which must stop the run without a checkpoint or DONE.json.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from tapetrain.config import load_run_config
from tapetrain.distributed import end_rank_process, init_distributed
from tapetrain.train.build import build_components
from tapetrain.train.schedule import lr_at
from tapetrain.train.trainer import NonFiniteLossError, Trainer


class InfGradient(torch.autograd.Function):
    """Identity forward; the backward multiplies the incoming gradient by inf (a gradient explosion)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class NanLossZeroGradient(torch.autograd.Function):
    """loss + NaN forward, zero gradient backward: a non-finite loss whose gradients come out finite (zero), the
    case where only the loss flag can stop AdamW from moving the weights by momentum and weight decay."""

    @staticmethod
    def forward(ctx, loss):
        return loss + float("nan")

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)


def snapshot(engine) -> dict[str, torch.Tensor]:
    """Bit patterns of everything an update may touch: the model's parameters (this rank's ZeRO-3 partitions),
    the fp32 tensors the client AdamW steps and its per-parameter state (moments, step counters)."""
    out = {}
    for name, p in engine.module.named_parameters():
        data = getattr(p, "ds_tensor", None)
        out[f"module.{name}"] = (p.data if data is None else data).detach().clone()
    opt = engine.basic_optimizer
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            out[f"master.{g}.{i}"] = p.detach().clone()
            for key, value in opt.state.get(p, {}).items():
                if torch.is_tensor(value):
                    out[f"state.{g}.{i}.{key}"] = value.detach().clone()
    return out


def bit_identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))
        for k in a
    )


def probe_stage(config: str, out_dir: Path, stage: int, env) -> dict:
    cfg = load_run_config(config, [f"deepspeed.zero_stage={stage}", f"run.out_dir={out_dir / f'stage{stage}'}",
                                   "train.on_nan=skip", "train.max_nan_skips=5"])
    cfg = cfg.resolve(env.world_size, env.device.type)
    trainer = Trainer(cfg, env, build_components(cfg, env))
    engine, model = trainer.engine, trainer.engine.module
    record: dict = {}

    def step():
        result = trainer.train_step()
        trainer.step += 1
        return result

    def injected(kind: str):
        """On rank 1 only: 'grad' = inf gradients under a finite loss, 'loss' = NaN loss (and so NaN gradients),
        'loss_only' = NaN loss with finite (zero) gradients."""

        def on_norm(_module, _inputs, output):
            return InfGradient.apply(output) if kind == "grad" else output + float("nan")

        def on_model(_module, _inputs, output):
            output.loss = NanLossZeroGradient.apply(output.loss)
            return output

        if env.rank != 1:
            return None
        return model.register_forward_hook(on_model) if kind == "loss_only" else model.norm.register_forward_hook(
            on_norm)

    step()
    for kind in ("grad", "loss", "loss_only"):
        before, skipped_before = snapshot(engine), trainer.skipped_steps
        handle = injected(kind)
        result = step()
        if handle is not None:
            handle.remove()
        record[kind] = {
            "unchanged": bit_identical(before, snapshot(engine)),
            "skipped": trainer.skipped_steps - skipped_before,
            "loss_finite": result["loss"] == result["loss"],  # the logged mean over finite micro-batch losses
            "grad_norm": result["grad_norm"],
            "lr_next": engine.get_lr()[0],
            "lr_expected": lr_at(trainer.step, cfg.optim, cfg.train.steps),
        }
    before = snapshot(engine)
    step()
    record["normal_step_changes_weights"] = not bit_identical(before, snapshot(engine))
    trainer.cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, on_nan="stop"))
    handle = injected("grad")
    try:
        step()
        record["stop"] = None
    except NonFiniteLossError as err:
        record["stop"] = str(err)
    if handle is not None:
        handle.remove()
    if env.rank == 1:
        with torch.no_grad():
            p = next(model.parameters())
            partition = getattr(p, "ds_tensor", None)
            (p.data if partition is None else partition)[0] = float("nan")
    trainer.cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=trainer.step))
    try:
        trainer.fit()
        record["nan_weights"] = None
    except NonFiniteLossError as err:
        record["nan_weights"] = str(err)
    record["done_json"] = (Path(cfg.run.out_dir) / "DONE.json").exists()
    record["checkpoints"] = sorted(p.name for p in (Path(cfg.run.out_dir) / "checkpoints").glob("step_*"))
    engine.destroy()
    return record


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    config, out_dir, stages = args[0], Path(args[1]), [int(s) for s in args[2].split(",")]
    torch.manual_seed(0)
    env = init_distributed()
    results = {stage: probe_stage(config, out_dir, stage, env) for stage in stages}
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
    end_rank_process(0)
