"""RunConfig -> DeepSpeed JSON. The only module that knows DeepSpeed's config key names.

Checked against DeepSpeed 0.19.8 (`deepspeed/runtime/config.py`, `runtime/zero/config.py`,
`runtime/zero/offload_config.py`, `runtime/precision_config.py`). No "optimizer"/"scheduler" blocks: tapetrain
passes its own AdamW (`tapetrain.train.optim`) and LR schedule (`tapetrain.train.schedule`) to
`deepspeed.initialize`.
"""

from __future__ import annotations

from typing import Any

from tapetrain.config.checks import grad_accum_steps
from tapetrain.config.run_config import RunConfig
from tapetrain.config.yaml_io import deep_merge

# We log ourselves (metrics.jsonl / TensorBoard); keep DeepSpeed's own periodic print out of the way.
STEPS_PER_PRINT = 1_000_000_000


def _zero_block(cfg: RunConfig) -> dict[str, Any]:
    d = cfg.deepspeed
    zero: dict[str, Any] = {"stage": d.zero_stage}
    if d.zero_stage == 0:
        return zero
    zero.update(
        contiguous_gradients=d.contiguous_gradients,
        reduce_scatter=d.reduce_scatter,
        reduce_bucket_size=d.reduce_bucket_size,
        allgather_bucket_size=d.allgather_bucket_size,
    )
    if d.overlap_comm is not None:
        zero["overlap_comm"] = d.overlap_comm
    if d.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": d.pin_memory}
    if d.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=d.stage3_prefetch_bucket_size,
            stage3_param_persistence_threshold=d.stage3_param_persistence_threshold,
            stage3_max_live_parameters=d.stage3_max_live_parameters,
            stage3_max_reuse_distance=d.stage3_max_reuse_distance,
            stage3_gather_16bit_weights_on_model_save=d.stage3_gather_16bit_weights_on_model_save,
        )
        if d.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": d.pin_memory}
    return zero


def build_deepspeed_config(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config dict for `cfg` on `world_size` ranks (world_size / parallel.sequence_parallel of them
    data parallel: DeepSpeed's batch sizes count each sequence once).

    Raises ConfigError (naming train.global_batch_size / train.micro_batch_size and a valid global batch) when
    the global batch is not a multiple of micro_batch_size × data-parallel ranks.
    """
    n = cfg.parallel.ranks_per_sequence  # DeepSpeed's "sequence parallel": every rank that shares a sequence
    accum = grad_accum_steps(cfg.train, world_size, n)
    micro = cfg.train.micro_batch_size
    d = cfg.deepspeed
    ds: dict[str, Any] = {
        "train_batch_size": micro * (world_size // n) * accum,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": _zero_block(cfg),
        "bf16": {"enabled": d.precision == "bf16"},
        "fp16": {"enabled": d.precision == "fp16"},
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if n > 1:
        # Read where no mpu is at hand (zero.Init under ZeRO-3): its batch check then counts world_size / N ranks.
        # The engine gets DeepSpeed's parallel_state_sp as mpu (tapetrain.parallel.ulysses).
        ds["sequence_parallel_size"] = n
    if d.precision == "fp16":
        ds["fp16"].update(loss_scale=d.loss_scale, initial_scale_power=d.initial_scale_power)
    if d.offload_optimizer:
        # The step then runs torch's AdamW on the CPU partitions (DeepSpeedCPUAdam would be faster but needs a
        # compiled extension); DeepSpeed refuses client optimizers under offload unless told this is intended.
        ds["zero_force_ds_cpu_optimizer"] = False
    return deep_merge(ds, cfg.deepspeed.extra)
