"""The sections of a run config, one dataclass each. Every field's `help` feeds the generated reference.

Conventions: `null` in YAML is Python `None`; "0 = off" is spelled out per field; `data.seq_len: null`
(= model.max_seq_len) is filled in by the loader so that a loaded config is explicit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from tapetrain.fields import option
from tapetrain.model.config import ModelConfig

Schedule = Literal["cosine", "linear", "polynomial", "constant", "wsd"]
Precision = Literal["fp32", "bf16", "fp16"]
Trainable = Literal["all", "tape", "tape+embed+norm", "lora", "lora+embed+norm"]
OnNan = Literal["skip", "stop"]
Float8 = Literal["off", "rowwise", "tensorwise"]
WandbMode = Literal["online", "offline", "disabled"]


@dataclass
class RunSection:
    """Where the run writes and how it is seeded."""

    out_dir: str = option(
        "runs/default",
        "Run directory: resolved config.yaml, ds_config.json, checkpoints/, tensorboard/, metrics.jsonl.",
    )
    seed: int = option(
        0, "Seed of model init, data order and random position offsets (same seed = same run)."
    )
    name: str | None = option(
        None, "Run name shown in logs and TensorBoard (null = the last part of out_dir)."
    )


@dataclass
class ModelSection(ModelConfig):
    """The model: a ModelConfig plus where its values and weights come from.

    `preset` fills every ModelConfig field from `tapetrain.model.presets`; keys given next to it override the
    preset. Use `model_config()` (or `to_dict()`, which omits `preset`/`init_from`) to hand the architecture
    to model code.
    """

    preset: str | None = option(
        None, "Named model shape to start from (tiny, paper-155m, llama-1b, llama2-7b, llama3.1-8b); other model keys "
        "override it."
    )
    init_from: str | None = option(
        None,
        "Weights to start from (null = random init): a Hugging Face checkpoint directory (Llama-2/3.x, Mistral, "
        "Qwen2/2.5, Qwen3), a tapetrain export (tapetrain export hf) or a tapetrain run directory / checkpoint "
        "directory (its newest complete checkpoint). Its shape and, unless this config sets them, its RoPE settings "
        "are used.",
    )

    def model_config(self) -> ModelConfig:
        """The architecture alone, as the plain ModelConfig that model code expects."""
        return ModelConfig(**{f.name: getattr(self, f.name) for f in fields(ModelConfig)})

    def to_dict(self) -> dict:
        """ModelConfig fields only, so that `ModelConfig.from_dict(section.to_dict())` works."""
        return self.model_config().to_dict()


@dataclass
class DataSource:
    """One token-shard directory (written by `tapetrain data prepare`) and its sampling weight."""

    path: str = option(help="Shard directory written by `tapetrain data prepare`: a local path or a URL in object "
                       "storage (s3://, gs://, hf://, https://).")
    weight: float = option(1.0, "Relative sampling weight when mixing several sources.")


def _sources(value: Any) -> Any:
    """YAML shorthand -> list of {path, weight}: 'dir' | ['a', 'b'] | [{path: a, weight: 2}, ...] | null."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"path": value}]
    if isinstance(value, list):
        return [{"path": item} if isinstance(item, str) else item for item in value]
    return value  # the type check reports it


@dataclass
class DataSection:
    """Training and validation token streams."""

    train: list[DataSource] = option(
        [],
        "Training shards: a directory, a list of directories, or a list of {path, weight} to mix sources. Paths "
        "in a config are relative to the working directory (only base: is relative to the file).",
        shown_type="path or list",
    )
    val: list[DataSource] = option(
        [],
        "Validation shards, same forms as data.train (empty = no evaluation during training). The val split of "
        "each directory is read, so the directory of data.train can be given again (prepare --val-fraction).",
        shown_type="path, list or null",
    )
    seq_len: int | None = option(None, "Tokens per training sequence (null = model.max_seq_len).")
    tokenizer: str | None = option(
        None, "Tokenizer the shards were written with: a sentencepiece .model, a tokenizer.json or a model "
        "directory; checked against the shard manifest (sha256). null = model.init_from's tokenizer if it has one, "
        "else the one the training data's manifest names. The run directory keeps a copy (tokenizer/)."
    )
    num_workers: int = option(1, "Background reader workers per rank (0 = read in the training process).")
    cache_dir: str | None = option(
        None,
        "Node-local cache of shards read from object storage (s3://, gs://, hf://, https:// data paths), shared by "
        "the ranks and runs of the node (null = $TMPDIR/tapetrain-cache-UID). Unused for local paths.",
    )
    cache_limit_gb: float | None = option(
        100.0,
        "Size limit of data.cache_dir in GB (1e9 bytes): least recently used shards not open in any reader are "
        "evicted beyond it (null = no limit).",
    )
    verify: bool = option(
        False,
        "Before training, check every shard's sha256 and token ids against its manifest (reads all data once, on "
        "rank 0; the same as `tapetrain data verify DIR`).",
    )
    packing: bool = option(
        False,
        "Supervised example data (tapetrain data arith / data scrolls): pack consecutive examples into each "
        "sequence instead of padding every example to seq_len; the loss stays on the answers only, and with "
        "data.document_mask (its default) every example attends only to itself, at positions from 0.",
    )
    document_mask: bool | None = option(
        None,
        "Respect document boundaries inside packed sequences: positions restart at 0 at every document start "
        "(after each EOS in token shards, at each example in packed example data) and attention stays within a "
        "document (docs/document-masking.md). null = on for packed supervised examples, off for token shards.",
        shown_type="bool or null",
    )

    @staticmethod
    def normalize_raw(raw: dict) -> dict:
        """Accept the YAML shorthands of data.train / data.val before type checking."""
        out = dict(raw)
        for key in ("train", "val"):
            if key in out:
                out[key] = _sources(out[key])
        return out


@dataclass
class LoraSection:
    """LoRA adapters (through `peft`) for the LoRA / LongLoRA baselines; merged into the weights on export."""

    r: int = option(8, "Adapter rank.")
    alpha: float = option(16.0, "Scaling numerator: the update is (alpha / r) · B·A.")
    dropout: float = option(0.0, "Dropout on the adapter input.")
    targets: list[str] = option(
        ["q_proj", "k_proj", "v_proj", "o_proj"], "Linear layers (by attribute name) that get adapters."
    )


@dataclass
class ProfileSection:
    """torch.profiler over a few optimizer steps: a trace per rank in RUN_DIR/profile/ (TensorBoard, Perfetto)."""

    start_step: int = option(10, "First profiled optimizer step (after warm-up: the first steps are not typical).")
    steps: int = option(3, "Number of optimizer steps profiled.")
    memory_snapshot: bool = option(
        True, "On CUDA, also record the allocator's history and dump a memory snapshot (pytorch.org/memory_viz)."
    )


@dataclass
class TrainSection:
    """Steps, batch sizes, intervals and what to do when things go wrong."""

    steps: int = option(1000, "Optimizer steps to train for (the LR schedule spans exactly these).")
    micro_batch_size: int = option(1, "Sequences per rank per forward/backward (micro step).")
    global_batch_size: int | None = option(
        None,
        "Sequences per optimizer step over all ranks; a multiple of micro_batch_size × world size "
        "(gradient accumulation is derived). null = micro_batch_size × world size.",
    )
    save_interval: int = option(
        1000, "Checkpoint every N steps (the last step is always saved; 0 = only it)."
    )
    log_interval: int = option(10, "Write metrics.jsonl and TensorBoard every N steps.")
    eval_interval: int = option(0, "Evaluate on data.val every N steps (0 = never).")
    eval_steps: int = option(
        50,
        "Validation batches of train.global_batch_size sequences in one evaluation: the first eval_steps × "
        "global_batch_size samples of data.val (at most all of them), the same samples on any number of ranks.",
    )
    keep_last: int = option(3, "Keep the newest K checkpoints, deleting older ones (0 = keep all).")
    resume: str = option(
        "auto",
        "'auto' = continue from the newest checkpoint in run.out_dir if any; 'none' = start fresh; "
        "or a checkpoint directory to start from.",
    )
    resume_fallback: bool = option(
        True,
        "With resume 'auto': when the newest checkpoint is damaged (a file differs from its manifest.json) or "
        "incomplete, resume from the newest intact one, naming the skipped checkpoint and why in the log; false = "
        "refuse to start instead. A checkpoint named in train.resume never falls back.",
    )
    trainable: Trainable = option(
        "all",
        "Parameters to train: all; tape (TAPE/positional parameters only); tape+embed+norm (plus embeddings "
        "and norms, the TAPE paper's PEFT setting); lora / lora+embed+norm (the adapters of train.lora, plus "
        "embeddings and norms as LongLoRA). Others are frozen and stay out of the optimizer.",
    )
    lora: LoraSection | None = option(None, "LoRA adapters (null = none); required by trainable=lora*.")
    on_nan: OnNan = option(
        "stop", "Non-finite loss or gradient: 'stop' with an error, or 'skip' the step (see max_nan_skips)."
    )
    max_nan_skips: int = option(10, "With on_nan=skip, stop after this many skipped steps in a row.")
    grad_clip: float = option(1.0, "Clip the global gradient norm to this (0 = no clipping).")
    random_position_offset: int = option(
        0, "Add a random offset in [0, N] to each sequence's positions while training (0 = off)."
    )
    profile: ProfileSection | None = option(
        None, "Profile train.profile.steps optimizer steps from start_step with torch.profiler (null = off)."
    )
    float8: Float8 = option(
        "off",
        "FP8 matmuls through torchao (docs/performance.md): 'rowwise' or 'tensorwise' scaling (torchao's recipes) for "
        "the attention and MLP projections whose dimensions are multiples of 16; never the embedding, lm_head or "
        "TAPE's head-axis updates. Needs a GPU with FP8 tensor cores (compute capability 8.9+) and, for speed, "
        "model.compile=true; 'off' = the precision of deepspeed.precision throughout.",
    )


@dataclass
class OptimSection:
    """AdamW and its learning-rate schedule (ours, not DeepSpeed's)."""

    lr: float = option(3e-4, "Peak learning rate (reached at the end of warmup).")
    min_lr: float = option(0.0, "Learning rate at the end of the decay (must be ≤ lr).")
    weight_decay: float = option(
        0.1, "AdamW decoupled weight decay, applied to ≥2-D weights except embeddings."
    )
    betas: tuple[float, float] = option((0.9, 0.95), "AdamW (beta1, beta2).")
    eps: float = option(1e-8, "AdamW epsilon.")
    schedule: Schedule = option(
        "cosine",
        "Decay after warmup: cosine, linear or polynomial (to min_lr), constant, or wsd "
        "(warmup-stable-decay: constant, then linear to min_lr over the last decay_ratio of steps).",
    )
    warmup_steps: int | None = option(
        None, "Linear warmup steps (set at most one of warmup_steps / warmup_ratio; neither = no warmup)."
    )
    warmup_ratio: float | None = option(None, "Warmup as a fraction of train.steps (rounded to whole steps).")
    decay_ratio: float = option(0.1, "wsd: fraction of train.steps spent decaying at the end.")
    power: float = option(1.0, "polynomial: exponent of the decay (1 = linear).")

    def warmup_for(self, total_steps: int) -> int:
        """Warmup length in steps for a run of `total_steps` steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_ratio is not None:
            return int(round(self.warmup_ratio * total_steps))
        return 0

    def decay_steps_for(self, total_steps: int) -> int:
        """wsd: length of the final decay phase in steps."""
        return int(round(self.decay_ratio * total_steps))


@dataclass
class DeepSpeedSection:
    """DeepSpeed engine settings; `build_deepspeed_config` turns them into DeepSpeed's JSON."""

    zero_stage: int = option(
        2,
        "ZeRO stage: 0 = plain data parallel, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters.",
    )
    precision: Precision = option(
        "bf16", "Training precision: fp32, bf16 (A100/H100) or fp16 (dynamic loss scaling). CPU needs fp32."
    )
    offload_optimizer: bool = option(
        False, "ZeRO-Offload: keep optimizer state and the step on the CPU (stage ≥ 1)."
    )
    offload_params: bool = option(
        False, "ZeRO-Infinity: keep parameters on the CPU between uses (stage 3 only)."
    )
    pin_memory: bool = option(
        True, "Pin the CPU buffers used by offloading (faster copies, more host memory)."
    )
    overlap_comm: bool | None = option(
        None, "Overlap gradient reduction with backward (null = DeepSpeed's default: on for stage 3)."
    )
    contiguous_gradients: bool = option(
        True, "Copy gradients into one buffer as they are produced (less fragmentation)."
    )
    reduce_scatter: bool = option(
        True, "Average gradients with reduce-scatter instead of all-reduce (stage ≥ 2)."
    )
    reduce_bucket_size: int = option(
        500_000_000, "Elements reduced at a time (memory vs. communication efficiency)."
    )
    allgather_bucket_size: int = option(
        500_000_000, "Elements all-gathered at a time after the step (stages 1-2)."
    )
    stage3_prefetch_bucket_size: int = option(50_000_000, "Stage 3: parameter elements fetched ahead of use.")
    stage3_param_persistence_threshold: int = option(
        100_000, "Stage 3: parameters smaller than this many elements stay unpartitioned."
    )
    stage3_max_live_parameters: int = option(
        1_000_000_000, "Stage 3: most parameter elements resident on a rank before releasing."
    )
    stage3_max_reuse_distance: int = option(
        1_000_000_000, "Stage 3: keep a parameter if it is reused within this many parameter elements."
    )
    stage3_gather_16bit_weights_on_model_save: bool = option(
        False, "Stage 3: also save consolidated 16-bit weights with each checkpoint (slow for big models)."
    )
    loss_scale: float = option(0.0, "fp16 only: static loss scale (0 = dynamic loss scaling).")
    initial_scale_power: int = option(16, "fp16 only: dynamic loss scaling starts at 2**this.")
    timeout_minutes: float = option(
        30.0,
        "Timeout of every collective, in every process group (also the groups DeepSpeed creates). A rank that "
        "does not arrive in time ends the job with a message naming the step and the rank (docs/run-directory.md). "
        "Raise it when ranks wait longer for one another, e.g. while rank 0 saves or converts a large checkpoint "
        "(DeepSpeed's own default is 10). Fractions are allowed (>= 0.2, i.e. 12 s, for tests).",
    )
    extra: dict[str, Any] = option(
        {},
        "Raw DeepSpeed JSON deep-merged last (e.g. {comms_logger: {enabled: true}}). Keys tapetrain owns "
        "(batch sizes, optimizer, scheduler, gradient_clipping, precision, ZeRO stage) are rejected.",
        shown_type="mapping",
    )


@dataclass
class ParallelSection:
    """How ranks share the work beyond data parallelism."""

    sequence_parallel: int = option(
        1,
        "Sequence parallelism (DeepSpeed-Ulysses): every sequence is split over a group of N consecutive ranks, each "
        "holding data.seq_len / N tokens, and attention trades tokens for heads with all-to-alls. Data parallel = "
        "world size / N; global batch = micro_batch_size × (world size / N) × accumulation. N must divide "
        "model.n_heads, data.seq_len and the world size, and should fit in one node. 1 = off.",
    )
    context_parallel: int = option(
        1,
        "Context parallelism (ring attention): every sequence is also split over a ring of R groups, each rank of the "
        "ring holding two opposite chunks (2R chunks of data.seq_len / 2R tokens, for the causal balance); keys and "
        "values pass around the ring, so R is not bounded by the heads and the ring may span nodes. Composes with "
        "parallel.sequence_parallel (Ulysses inside each group of U ranks, the ring across them): each sequence is "
        "shared by R × U consecutive ranks, data parallel = world size / (R × U). data.seq_len must be a multiple "
        "of 2 × R × U. 1 = off.",
    )

    @property
    def ranks_per_sequence(self) -> int:
        """The consecutive ranks that share each sequence: context_parallel × sequence_parallel."""
        return self.sequence_parallel * self.context_parallel


@dataclass
class WandbSection:
    """Weights & Biases: the same scalars as metrics.jsonl and TensorBoard (needs `pip install "tapetrain[wandb]"`)."""

    project: str = option("tapetrain", "W&B project.")
    entity: str | None = option(None, "W&B team or user (null = your default entity).")
    name: str | None = option(None, "W&B run name (null = run.name, else the last part of run.out_dir).")
    tags: list[str] = option([], "W&B run tags.")
    mode: WandbMode | None = option(
        None, "online, offline (files only, `wandb sync` later) or disabled (null = $WANDB_MODE, else online)."
    )


@dataclass
class LoggingSection:
    """Console, TensorBoard and metrics."""

    tensorboard: bool = option(True, "Write TensorBoard events under run.out_dir/tensorboard (rank 0).")
    console_interval: int | None = option(
        None, "Print a progress line every N steps (null = train.log_interval)."
    )
    peak_tflops: float | None = option(
        None,
        "Per-device peak TFLOP/s used for MFU (null = look up the GPU model; no MFU on unknown devices).",
    )
    wandb: WandbSection | None = option(
        None,
        "Weights & Biases logging, off by default (null); its files go to RUN_DIR/wandb/, and a resumed run "
        "continues the same W&B run.",
    )
