"""Cross-field validation: values that type-check but cannot work together; messages name key and fix."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from tapetrain.config.typed import Locate, where
from tapetrain.errors import ConfigError

if TYPE_CHECKING:
    from tapetrain.config.run_config import RunConfig
    from tapetrain.config.sections import TrainSection

# DeepSpeed JSON keys that tapetrain derives itself -> the tapetrain key to set instead.
RESERVED_DEEPSPEED_KEYS = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size (accumulation is derived)",
    "gradient_clipping": "train.grad_clip",
    "optimizer": "optim.* (tapetrain passes its own AdamW)",
    "scheduler": "optim.schedule (tapetrain passes its own LR schedule)",
    "bfloat16": "deepspeed.precision",
    "sequence_parallel_size": "parallel.sequence_parallel",
    "data_parallel_size": "parallel.sequence_parallel (data parallel = world size / sequence_parallel)",
}
RESERVED_NESTED_KEYS = {
    ("bf16", "enabled"): "deepspeed.precision",
    ("fp16", "enabled"): "deepspeed.precision",
    ("zero_optimization", "stage"): "deepspeed.zero_stage",
    # The gradient-norm check is what skips updates with non-finite gradients (train.on_nan).
    ("zero_optimization", "compute_grad_norm"): "train.on_nan (the gradient norm must be computed)",
    ("bf16", "check_grad_overflow"): "train.on_nan (non-finite gradients are always checked)",
}
PRETRAINED_PE_MODES = ("tape", "tape+embed+norm")
# Bounds no run reaches: a value past them is a typo (an extra digit, a wrong exponent), not a plan. They also keep
# counts inside int64 (numpy, torch and DeepSpeed store them there).
MAX_STEPS = 10**9  # a billion optimizer steps: centuries at one step a second
MAX_BATCH = 2**24  # sequences per step
MAX_SEQ_LEN = 2**24  # 16Mi tokens per sequence
# optim.lr has no upper bound: a huge LR is how a diverging run is reproduced on purpose (the NaN tests use 1e30).


# A collective that times out names the ranks whose heartbeat stopped (tapetrain.train.heartbeat: written every 2 s,
# stale after 7 s); a rank stopped just after a beat is seen as stale only once the timeout exceeds that by a beat.
MIN_TIMEOUT_MINUTES = 0.2


class _Checker:
    def __init__(self, locate: Locate):
        self.locate = locate

    def fail(self, key: str, problem: str, fix: str) -> None:
        raise ConfigError(f"{key}: {problem}{where(self.locate, key)}; {fix}")

    def positive(self, key: str, value: float | None, fix: str = "set a positive number") -> None:
        if value is not None and not (value > 0 and math.isfinite(value)):
            self.fail(key, f"must be > 0, got {value}", fix)

    def non_negative(self, key: str, value: float | None, fix: str = "set 0 or a positive number") -> None:
        if value is not None and not (value >= 0 and math.isfinite(value)):
            self.fail(key, f"must be >= 0, got {value}", fix)

    def at_most(self, key: str, value: float | None, limit: float, fix: str) -> None:
        if value is not None and value > limit:
            self.fail(key, f"must be <= {limit}, got {value}", fix)

    def fraction(self, key: str, value: float | None, *, low_open: bool, high_open: bool) -> None:
        if value is None:
            return
        low_ok = value > 0 if low_open else value >= 0
        high_ok = value < 1 if high_open else value <= 1
        if not (low_ok and high_ok):
            interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
            self.fail(key, f"must be in {interval}, got {value}", f"set a fraction in {interval}")


def nearest_multiples(value: int, unit: int) -> list[int]:
    """Positive multiples of `unit` around `value`, closest first."""
    lower = (value // unit) * unit
    candidates = [c for c in (lower, lower + unit) if c > 0]
    return sorted(candidates, key=lambda c: (abs(c - value), c))


def grad_accum_steps(train: TrainSection, world_size: int, sequence_parallel: int = 1) -> int:
    """global_batch_size / (micro_batch_size × data-parallel ranks), or a ConfigError naming keys and a valid batch.
    Data-parallel ranks = world_size / sequence_parallel (a sequence-parallel group shares its sequences)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}; check WORLD_SIZE")
    data_parallel = world_size // sequence_parallel
    unit = train.micro_batch_size * data_parallel
    ranks = "world size" if sequence_parallel == 1 else (
        f"data-parallel ranks (world size {world_size} / parallel.sequence_parallel {sequence_parallel})")
    global_batch = unit if train.global_batch_size is None else train.global_batch_size
    if global_batch % unit:
        options = nearest_multiples(global_batch, unit)
        raise ConfigError(
            f"train.global_batch_size={global_batch} is not divisible by "
            f"train.micro_batch_size × {ranks} = {train.micro_batch_size} × {data_parallel} = {unit}; "
            f"use train.global_batch_size={options[0]}"
            + (f" (or {options[1]})" if len(options) > 1 else "")
            + ", or change train.micro_batch_size"
        )
    return global_batch // unit


def check_run_config(cfg: RunConfig, locate: Locate) -> None:
    """Raise ConfigError for the first impossible combination of values in a loaded config."""
    c = _Checker(locate)
    _check_run(cfg, c)
    _check_model(cfg, c)
    _check_data(cfg, c)
    _check_train(cfg, c)
    _check_optim(cfg, c)
    _check_deepspeed(cfg, c)
    _check_parallel(cfg, c)
    _check_logging(cfg, c)


def _check_run(cfg: RunConfig, c: _Checker) -> None:
    if not cfg.run.out_dir.strip():
        c.fail("run.out_dir", "is empty", "set a directory, e.g. runs/my-run")
    c.non_negative("run.seed", cfg.run.seed, "set a non-negative integer seed")


def _check_model(cfg: RunConfig, c: _Checker) -> None:
    try:
        cfg.model.validate()
    except ConfigError as err:
        match = re.match(r"(model\.\w+)", str(err))
        raise ConfigError(f"{err}{where(c.locate, match.group(1)) if match else ''}") from None
    if cfg.model.init_from is not None and not cfg.model.init_from.strip():
        c.fail("model.init_from", "is an empty string", "set a Hugging Face Llama directory or null")


def _check_data(cfg: RunConfig, c: _Checker) -> None:
    data = cfg.data
    if not data.train:
        c.fail(
            "data.train",
            "no training data given",
            "set data.train to a shard directory written by `tapetrain data prepare`",
        )
    for name in ("train", "val"):
        for i, source in enumerate(getattr(data, name)):
            if not source.path.strip():
                c.fail(f"data.{name}[{i}].path", "is empty", "set the shard directory")
            c.positive(f"data.{name}[{i}].weight", source.weight, "set a positive sampling weight")
    assert data.seq_len is not None  # filled in by the loader
    c.positive("data.seq_len", data.seq_len, "set the sequence length in tokens, e.g. 1024")
    c.at_most("data.seq_len", data.seq_len, MAX_SEQ_LEN, "set the sequence length in tokens, e.g. 1024")
    if data.seq_len > cfg.model.max_seq_len:
        c.fail(
            "data.seq_len",
            f"{data.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len} (the training context length)",
            f"lower data.seq_len or raise model.max_seq_len to {data.seq_len}",
        )
    c.non_negative("data.num_workers", data.num_workers, "set 0 (read in process) or a worker count")
    c.positive("data.cache_limit_gb", data.cache_limit_gb, "set the shard cache's size in GB, or null for no limit")


def _check_train(cfg: RunConfig, c: _Checker) -> None:
    t = cfg.train
    c.positive("train.steps", t.steps, "set the number of optimizer steps, e.g. train.steps=1000")
    c.positive("train.micro_batch_size", t.micro_batch_size, "set the sequences per rank per micro step")
    c.positive("train.global_batch_size", t.global_batch_size, "set a positive batch size or null")
    _check_step_counts(cfg, c)
    if t.global_batch_size is not None and t.global_batch_size % t.micro_batch_size:
        options = nearest_multiples(t.global_batch_size, t.micro_batch_size)
        c.fail(
            "train.global_batch_size",
            f"{t.global_batch_size} is not a multiple of train.micro_batch_size={t.micro_batch_size}",
            f"use train.global_batch_size={options[0]}, or change train.micro_batch_size",
        )
    c.non_negative("train.save_interval", t.save_interval, "set 0 to save only at the last step")
    c.positive("train.log_interval", t.log_interval, "set a logging interval in steps, e.g. 10")
    c.non_negative("train.eval_interval", t.eval_interval, "set 0 to disable evaluation")
    if t.eval_interval and not cfg.data.val:
        c.fail(
            "train.eval_interval",
            f"is {t.eval_interval} but data.val is empty",
            "set data.val or train.eval_interval=0",
        )
    c.positive("train.eval_steps", t.eval_steps,
               "set the validation batches (of train.global_batch_size sequences) per evaluation, e.g. 10")
    c.non_negative("train.keep_last", t.keep_last, "set 0 to keep every checkpoint")
    if not t.resume.strip():
        c.fail("train.resume", "is empty", "use 'auto', 'none' or a checkpoint directory")
    if t.trainable in PRETRAINED_PE_MODES and cfg.model.pe != "tape":
        c.fail(
            "train.trainable",
            f"{t.trainable!r} trains TAPE parameters but model.pe={cfg.model.pe!r} has none",
            "set model.pe=tape or train.trainable=all",
        )
    if t.trainable.startswith("lora") and t.lora is None:
        c.fail("train.trainable", f"is {t.trainable!r} but train.lora is null", "add a train.lora: {r: 8, alpha: 16}")
    if t.lora is not None:
        c.positive("train.lora.r", t.lora.r, "set the adapter rank, e.g. 8")
    if t.profile is not None:
        c.positive("train.profile.start_step", t.profile.start_step, "set the first profiled step, e.g. 10")
        c.positive("train.profile.steps", t.profile.steps, "set how many steps to profile, e.g. 3")
        if t.profile.start_step > t.steps:
            c.fail("train.profile.start_step", f"is {t.profile.start_step} but the run ends at train.steps={t.steps}",
                   f"profile a step the run reaches, e.g. train.profile.start_step={min(10, t.steps)}")
    c.non_negative("train.max_nan_skips", t.max_nan_skips, "set how many skipped steps in a row to tolerate")
    c.non_negative("train.grad_clip", t.grad_clip, "set 0 to disable clipping, e.g. 1.0")
    c.non_negative(
        "train.random_position_offset", t.random_position_offset, "set 0 to disable random offsets"
    )
    if t.random_position_offset and not cfg.model.model_config().shift_invariant:
        variant = " with tape_equivariant=false" if cfg.model.pe == "tape" else ""
        c.fail(
            "train.random_position_offset",
            f"is {t.random_position_offset} but model.pe={cfg.model.pe}{variant} is not shift-invariant (its logits "
            "depend on absolute positions), so the offset would change what the model learns",
            "set train.random_position_offset=0",
        )


def _check_step_counts(cfg: RunConfig, c: _Checker) -> None:
    """Upper bounds of the counts in train.*: a value no run reaches is a typo."""
    t = cfg.train
    steps_fix = f"no run takes over {MAX_STEPS} steps; check for a typo (an extra digit?)"
    for key in ("steps", "save_interval", "log_interval", "eval_interval", "eval_steps", "keep_last", "max_nan_skips"):
        c.at_most(f"train.{key}", getattr(t, key), MAX_STEPS, steps_fix)
    batch_fix = "set sequences per step that fit a cluster's memory, e.g. 512"
    for key in ("micro_batch_size", "global_batch_size"):
        c.at_most(f"train.{key}", getattr(t, key), MAX_BATCH, batch_fix)


def _check_optim(cfg: RunConfig, c: _Checker) -> None:
    o, steps = cfg.optim, cfg.train.steps
    c.positive("optim.lr", o.lr, "set a peak learning rate, e.g. 3e-4")
    c.at_most("optim.warmup_steps", o.warmup_steps, MAX_STEPS, "set a number of warmup steps below train.steps")
    c.non_negative("optim.min_lr", o.min_lr, "set a final learning rate, e.g. 0 or lr/10")
    if o.min_lr > o.lr:
        c.fail("optim.min_lr", f"{o.min_lr} is above optim.lr={o.lr}", "set optim.min_lr <= optim.lr")
    c.non_negative("optim.weight_decay", o.weight_decay, "set 0 to disable weight decay, e.g. 0.1")
    for i, beta in enumerate(o.betas):
        c.fraction(f"optim.betas[{i}]", beta, low_open=False, high_open=True)
    c.positive("optim.eps", o.eps, "set a small positive epsilon, e.g. 1e-8")
    if o.warmup_steps is not None and o.warmup_ratio is not None:
        c.fail(
            "optim.warmup_ratio",
            f"both optim.warmup_steps={o.warmup_steps} and optim.warmup_ratio={o.warmup_ratio} are set",
            "set one of them to null",
        )
    c.non_negative("optim.warmup_steps", o.warmup_steps, "set a number of warmup steps or null")
    c.fraction("optim.warmup_ratio", o.warmup_ratio, low_open=False, high_open=True)
    warmup = o.warmup_for(steps)
    if warmup >= steps:
        key = "optim.warmup_steps" if o.warmup_steps is not None else "optim.warmup_ratio"
        c.fail(key, f"warmup of {warmup} steps is not shorter than train.steps={steps}", "shorten the warmup")
    c.fraction("optim.decay_ratio", o.decay_ratio, low_open=True, high_open=False)
    if o.schedule == "wsd":
        decay = o.decay_steps_for(steps)
        if decay < 1:
            c.fail(
                "optim.decay_ratio",
                f"gives {decay} decay steps of train.steps={steps}",
                "raise optim.decay_ratio",
            )
        if warmup + decay > steps:
            c.fail(
                "optim.decay_ratio",
                f"warmup ({warmup}) + decay ({decay}) steps exceed train.steps={steps}",
                "lower optim.decay_ratio or the warmup",
            )
    c.positive("optim.power", o.power, "set a positive exponent, e.g. 1.0")


def _check_deepspeed(cfg: RunConfig, c: _Checker) -> None:
    d = cfg.deepspeed
    if d.zero_stage not in (0, 1, 2, 3):
        c.fail(
            "deepspeed.zero_stage", f"must be 0, 1, 2 or 3, got {d.zero_stage}", "pick a ZeRO stage, e.g. 2"
        )
    if d.offload_params and d.zero_stage != 3:
        c.fail(
            "deepspeed.offload_params",
            f"parameter offload needs ZeRO stage 3 but deepspeed.zero_stage={d.zero_stage}",
            "set deepspeed.zero_stage=3 or deepspeed.offload_params=false",
        )
    if cfg.model.compile and d.zero_stage == 3:
        c.fail(
            "model.compile",
            "torch.compile of the layers is not supported with deepspeed.zero_stage=3 (ZeRO-3 gathers and "
            "releases parameters in module hooks, which break the compiled graphs)",
            "set model.compile=false, or use deepspeed.zero_stage 1 or 2",
        )
    if d.offload_optimizer and d.zero_stage == 0:
        c.fail(
            "deepspeed.offload_optimizer",
            "optimizer offload needs ZeRO stage >= 1 but deepspeed.zero_stage=0",
            "set deepspeed.zero_stage to 1, 2 or 3, or deepspeed.offload_optimizer=false",
        )
    c.positive("deepspeed.timeout_minutes", d.timeout_minutes, "set the collective timeout in minutes, e.g. 30")
    if 0 < d.timeout_minutes < MIN_TIMEOUT_MINUTES:
        c.fail("deepspeed.timeout_minutes",
               f"must be >= {MIN_TIMEOUT_MINUTES:g} ({MIN_TIMEOUT_MINUTES * 60:g} s), got {d.timeout_minutes:g}: a "
               "shorter timeout cannot tell a hung rank from a heartbeat a few seconds late",
               f"set e.g. 30 (minutes), or {MIN_TIMEOUT_MINUTES:g} in tests")
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"):
        c.positive(f"deepspeed.{key}", getattr(d, key), "set a positive element count, e.g. 5e8")
    for key in (
        "stage3_param_persistence_threshold",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
    ):
        c.non_negative(f"deepspeed.{key}", getattr(d, key), "set a non-negative element count")
    c.non_negative("deepspeed.loss_scale", d.loss_scale, "set 0 for dynamic loss scaling")
    c.positive("deepspeed.initial_scale_power", d.initial_scale_power, "use e.g. 16")
    for key, ours in RESERVED_DEEPSPEED_KEYS.items():
        if key in d.extra:
            c.fail(f"deepspeed.extra.{key}", "is derived by tapetrain", f"set {ours} instead")
    for (outer, inner), ours in RESERVED_NESTED_KEYS.items():
        if isinstance(d.extra.get(outer), dict) and inner in d.extra[outer]:
            c.fail(f"deepspeed.extra.{outer}.{inner}", "is derived by tapetrain", f"set {ours} instead")
    for key, value in d.extra.items():
        if key in ("zero_optimization", "bf16", "fp16") and not isinstance(value, dict):
            c.fail(
                f"deepspeed.extra.{key}",
                f"must be a mapping, got {value!r}",
                "write it as a mapping of DeepSpeed keys",
            )


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def sequence_parallel_heads_problem(n_heads: int, sequence_parallel: int) -> tuple[str, str] | None:
    """(problem, fix) when `sequence_parallel` cannot split attention over `n_heads` query heads, else None. Also
    checked once model.init_from has set the head count."""
    if n_heads % sequence_parallel == 0:
        return None
    problem = (f"{sequence_parallel} does not divide model.n_heads={n_heads} (each rank of a group attends with "
               "n_heads / N whole heads)")
    return problem, f"set parallel.sequence_parallel to a divisor of {n_heads}: {_divisors(n_heads)}"


def _check_parallel(cfg: RunConfig, c: _Checker) -> None:
    n = cfg.parallel.sequence_parallel
    c.positive("parallel.sequence_parallel", n, "set 1 (off) or the ranks that share each sequence, e.g. 8")
    _check_context_parallel(cfg, c)
    if n == 1:
        return
    heads = sequence_parallel_heads_problem(cfg.model.n_heads, n)
    if heads:
        c.fail("parallel.sequence_parallel", *heads)
    seq_len = cfg.data.seq_len
    assert seq_len is not None
    if seq_len % n:
        options = nearest_multiples(seq_len, n)
        c.fail("data.seq_len", f"{seq_len} is not a multiple of parallel.sequence_parallel={n} (every rank of a "
               f"group holds seq_len / N tokens)", f"use data.seq_len={options[0]}"
               + (f" (or {options[1]})" if len(options) > 1 else ""))
    if cfg.model.s2_attn:
        c.fail("model.s2_attn", f"shifted sparse attention is not supported with parallel.sequence_parallel={n} (its "
               "token groups and the half-group roll span the ranks' slices)",
               "set model.s2_attn=false (full attention, which sequence parallelism makes affordable) or "
               "parallel.sequence_parallel=1")
    if cfg.model.compile:
        c.fail("model.compile", f"torch.compile of the layers is not supported with parallel.sequence_parallel={n}: "
               "the Ulysses all-to-all is an autograd function that fills a buffer with a collective, which a "
               "compiled graph may trace without its gradient", "set model.compile=false or "
               "parallel.sequence_parallel=1")


def _check_context_parallel(cfg: RunConfig, c: _Checker) -> None:
    r, u = cfg.parallel.context_parallel, cfg.parallel.sequence_parallel
    c.positive("parallel.context_parallel", r, "set 1 (off) or the ranks of the ring, e.g. 4")
    if not isinstance(r, int) or r <= 1 or not isinstance(u, int) or u < 1:
        return
    seq_len = cfg.data.seq_len or 0
    if seq_len % (2 * r * u):
        options = nearest_multiples(seq_len, 2 * r * u)
        c.fail("data.seq_len", f"{seq_len} is not a multiple of 2 × parallel.context_parallel × "
               f"parallel.sequence_parallel = {2 * r * u} (each of the ring's {2 * r} chunks is split over "
               f"{u} rank(s))", f"use data.seq_len={options[0]}" + (f" (or {options[1]})" if len(options) > 1 else ""))
    if cfg.model.s2_attn:
        c.fail("model.s2_attn", f"shifted sparse attention is not supported with parallel.context_parallel={r} "
               "(its token groups span the ring's chunks)", "set model.s2_attn=false or parallel.context_parallel=1")
    if cfg.model.compile:
        c.fail("model.compile", f"torch.compile of the layers is not supported with parallel.context_parallel={r}: "
               "the ring's transfers run inside an autograd function", "set model.compile=false or "
               "parallel.context_parallel=1")


def _check_logging(cfg: RunConfig, c: _Checker) -> None:
    c.positive("logging.console_interval", cfg.logging.console_interval, "set a step interval or null")
    c.positive("logging.peak_tflops", cfg.logging.peak_tflops, "set the device's peak TFLOP/s or null")


def check_for_world(cfg: RunConfig, world_size: int, device_type: str | None) -> int:
    """Checks that need the world size / device type; returns the gradient accumulation steps."""
    n = cfg.parallel.ranks_per_sequence
    if cfg.parallel.context_parallel > 1 and isinstance(world_size, int) and world_size >= 1 and world_size % n:
        raise ConfigError(
            f"parallel.context_parallel={cfg.parallel.context_parallel} × parallel.sequence_parallel="
            f"{cfg.parallel.sequence_parallel} = {n} ranks share each sequence, which does not divide the "
            f"{world_size} rank(s) of this launch; launch a multiple of {n} ranks or lower parallel.context_parallel"
        )
    if isinstance(world_size, int) and world_size >= 1 and world_size % n:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0 and cfg.model.n_heads % d == 0
                and (cfg.data.seq_len or 0) % d == 0]
        raise ConfigError(
            f"parallel.sequence_parallel={n} does not divide the {world_size} rank(s) of this launch (groups of N "
            f"ranks share each sequence); launch a multiple of {n} ranks, or set parallel.sequence_parallel to one "
            f"of {', '.join(map(str, fits))}"
        )
    accum = grad_accum_steps(cfg.train, world_size, n)
    if device_type == "cpu" and cfg.deepspeed.precision != "fp32":
        raise ConfigError(
            f"deepspeed.precision={cfg.deepspeed.precision} is not supported on CPU (no GPU found); "
            "set deepspeed.precision=fp32"
        )
    return accum
