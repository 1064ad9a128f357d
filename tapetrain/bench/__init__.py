"""Performance benchmarks behind `tools/benchmark.py` (README.md "Performance"). Measurements only, never pass/fail.

  attention  fused-attention micro-benchmark: RoPE attention (q, k, v) vs TAPE attention (values V plus the
             positional stream E) per backend and sequence length; forward and forward+backward.
  train      optimizer steps of TAPE and its RoPE twin (same preset, same everything but `pe`) in one process:
             tokens/s, step time, MFU, peak memory.
  engine     DeepSpeed overhead: a one-rank DeepSpeed engine vs a plain PyTorch loop doing the same arithmetic.
  layer      one decoder layer's activation memory, measured, vs the memory model.
  data       `prepare` throughput at 1 and 2 workers and the batch reader's throughput per sequence length.
  docmask    the training step with and without the document mask (data.document_mask), alternated step by
             step in one process: step-time spread per variant and per-pair ratio (module docstring).
  sp         sequence parallelism (DeepSpeed-Ulysses) on N CPU ranks it launches (gloo): SP 1 vs SP N alternated
             step by step, tokens/s and activation bytes saved for backward per rank (module docstring).
  cp         context parallelism (ring attention): the sp measurement with the N ranks as one ring.

One module per mode (attention, train, engine, layer, data, sp, cp, docmask), each with its options (`cli` builds the
parser from them); `header` holds the header every mode's JSON starts with (mode, date, device, machine, versions),
`arguments` the option blocks the modes share, `common` device, dtype, timing and memory helpers, `report` tables,
JSON and figures, `steps` the models, optimizer and timed steps that train, engine and layer share. The names below
are re-exported so that callers use `from tapetrain import bench; bench.X`.

Timing: the compared variants are alternated call by call in one process, the order rotated every round, after
warm-up (tapetrain.bench.pairs): a slow moment of a shared machine then falls on every variant of that round.
CUDA events (attention) or `torch.cuda.synchronize` + perf_counter around whole steps (train, engine);
perf_counter on CPU. Reported times are medians over the rounds, tokens/s = tokens per step / median step time,
and ratios are the median of the per-round ratio with its min–max and IQR; a ratio from fewer than
MIN_HEADLINE_PAIRS (10) rounds is marked as no headline. The JSON also holds every step time.

Peak memory (`peak_mem_gb`, GiB), measured while a variant is built and warmed up on its own: on CUDA
`torch.cuda.max_memory_allocated` over that span minus what was allocated before it (the variants built earlier
stay resident for the timed rounds), i.e. the model, optimizer state and activations. On CPU (Linux) the peak
resident set of the process over that span (VmHWM, reset through /proc/self/clear_refs) minus the resident set
just before it, i.e. the host memory the model, optimizer and activations added; `null` where /proc does not
allow that. `peak_mem_kind` in the JSON says which of the two a number is.

Low-precision training (bf16/fp16): the module is cast to that dtype, as DeepSpeed's bf16 engine does, and the
plain loops keep fp32 master weights for AdamW (grads upcast, clipped and applied in fp32, weights copied back),
again as DeepSpeed does, so that `train` and `engine` time the arithmetic a real run performs.
"""

from tapetrain.bench.attention import (
    ATTENTION_BACKENDS,
    ROPE_BACKENDS,
    TAPE_BACKENDS,
    AttentionCase,
    AttentionSettings,
    attention_cases,
    attention_flops,
    attention_report,
    plot_attention,
    run_attention_benchmark,
)
from tapetrain.bench.common import (
    DTYPES,
    GIB,
    PeakMemory,
    default_dtype,
    device_name,
    pick_device,
    release_memory,
    synchronize,
    time_call,
)
from tapetrain.bench.data import DataSettings, data_report, run_data_benchmark
from tapetrain.bench.docmask import DocmaskSettings, docmask_report, plot_docmask, run_docmask_benchmark
from tapetrain.bench.docmask import check_settings as check_docmask_settings
from tapetrain.bench.engine import (
    ENGINE_TARGET,
    EngineSettings,
    engine_ds_config,
    engine_report,
    plot_engine,
    run_engine_benchmark,
)
from tapetrain.bench.header import HEADER_KEYS, report_header, software_versions
from tapetrain.bench.layer import LayerSettings, layer_report, plot_layer, run_layer_benchmark
from tapetrain.bench.pairs import MAX_WARMUP_ROUNDS, MIN_HEADLINE_PAIRS
from tapetrain.bench.report import format_table, write_json_atomic
from tapetrain.bench.sp import SpSettings, plot_sp, run_sp_benchmark, sp_report
from tapetrain.bench.sp import check_settings as check_sp_settings
from tapetrain.bench.steps import (
    PlainOptimizer,
    StepResult,
    build_model,
    parse_overrides,
    plain_step,
    random_batches,
    timed_steps,
    warm_up_process,
)
from tapetrain.bench.train import TrainSettings, plot_train, run_train_benchmark, train_report

__all__ = [
    # common
    "DTYPES", "GIB", "PeakMemory", "default_dtype", "device_name", "pick_device", "release_memory", "synchronize",
    "time_call",
    # header
    "HEADER_KEYS", "report_header", "software_versions",
    # report
    "format_table", "write_json_atomic",
    # steps
    "PlainOptimizer", "StepResult", "build_model", "parse_overrides", "plain_step", "random_batches", "timed_steps",
    "warm_up_process",
    # modes
    "ATTENTION_BACKENDS", "ROPE_BACKENDS", "TAPE_BACKENDS", "AttentionCase", "AttentionSettings", "attention_cases",
    "attention_flops", "attention_report", "plot_attention", "run_attention_benchmark",
    "TrainSettings", "plot_train", "run_train_benchmark", "train_report",
    "ENGINE_TARGET", "EngineSettings", "engine_ds_config", "engine_report", "plot_engine", "run_engine_benchmark",
    "LayerSettings", "layer_report", "plot_layer", "run_layer_benchmark",
    "DataSettings", "data_report", "run_data_benchmark",
    "MAX_WARMUP_ROUNDS", "MIN_HEADLINE_PAIRS",
    "SpSettings", "check_sp_settings", "plot_sp", "run_sp_benchmark", "sp_report",
    "DocmaskSettings", "check_docmask_settings", "docmask_report", "plot_docmask", "run_docmask_benchmark",
]  # fmt: skip
