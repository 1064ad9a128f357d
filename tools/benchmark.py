#!/usr/bin/env python
"""Performance benchmarks (README.md "Performance" lists the targets and results); logic lives in tapetrain.bench
(one module per mode, each with its options; the parser in tapetrain.bench.cli).

  python tools/benchmark.py attention [--seq-lens 1024,2048] [--backends sdpa,triton] [--out R.json]
  python tools/benchmark.py train --preset paper-155m --seq-len 1024 [--batch 8] [--pe-list tape,rope] --out R.json
  python tools/benchmark.py engine --preset tiny [--zero-stage 2] --out R.json
  python tools/benchmark.py data [--corpus-mb 8] [--seq-lens 512,2048,8192] [--remote-latency-ms 50] [--out R.json]
  python tools/benchmark.py docmask --preset tiny --seq-len 1024 --docs 8 [--pairs 20] [--pe tape] --out R.json
  python tools/benchmark.py bakeoff [--head-dims 64,128] [--seq-lens 2048,8192] [--budget-s 180] --out R.json
  python tools/benchmark.py sp --ranks 2 --preset tiny --seq-len 1024 [--pairs 10] [--pe-list tape,rope] --out R.json
  python tools/benchmark.py cp --ranks 2 --preset tiny --seq-len 2048 [--pairs 10] [--pe-list tape,rope] --out R.json

Every mode prints a table; with --out it writes JSON (atomically) and a PNG next to it (--plot P.png to move it,
--no-plot to skip). Defaults depend on the device: small sizes and fp32 on CPU, realistic sizes and bf16 on CUDA.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from tapetrain import bench
from tapetrain.bench.cli import build_parser
from tapetrain.errors import ConfigError
from tapetrain.model import get_preset

# Per-device defaults: (CPU, CUDA). CPU ones keep each mode under ~2 minutes on 2 shared cores.
DEFAULTS = {
    "attention": {
        "seq_lens": ([128, 256], [1024, 2048, 4096, 8192]),
        "batch": (1, 4),
        "iters": (10, 30),
        "warmup": (2, 10),
    },
    "train": {"batch": (2, 8), "steps": (10, 20), "warmup": (3, 5)},
    "engine": {"batch": (2, 8), "steps": (20, 50), "warmup": (3, 10)},
}


def _default(mode: str, key: str, value, cuda: bool):
    return value if value is not None else DEFAULTS[mode][key][int(cuda)]


def _seq_len(args: argparse.Namespace, cuda: bool) -> int:
    if args.seq_len is not None:
        return args.seq_len
    max_len = get_preset(args.preset)["max_seq_len"]
    return max_len if cuda else min(max_len, 128)


def _emit(args: argparse.Namespace, result: dict, report: str, plot) -> None:
    print(report)
    if args.out:
        print(f"wrote {bench.write_json_atomic(args.out, result)}")
    plot_path = args.plot or (args.out.with_suffix(".png") if args.out else None)
    if plot_path and not args.no_plot:
        print(f"wrote {plot(result, plot_path)}")


def _checked_run(args: argparse.Namespace, settings, check, run, report, plot) -> int:
    """Refuse impossible settings in one line (exit 2) before any work, then run, print and write."""
    try:
        check(settings)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = run(settings, progress=not args.no_progress)
    _emit(args, result, report(result), plot)
    return 0


def _sp(args: argparse.Namespace) -> int:
    settings = bench.SpSettings(
        preset=args.preset,
        seq_len=args.seq_len,
        ranks=args.ranks,
        batch=args.batch,
        pairs=args.pairs,
        warmup=args.warmup,
        dtype=args.dtype or "fp32",
        pe_list=args.pe_list,
        backend=args.backend,
        overrides=bench.parse_overrides(args.overrides),
        threads=args.threads or 1,
        allow_few_pairs=args.allow_few_pairs,
        seed=args.seed,
        ring=args.mode == "cp",
    )
    return _checked_run(args, settings, bench.check_sp_settings, bench.run_sp_benchmark, bench.sp_report,
                        bench.plot_sp)


def _docmask(args: argparse.Namespace) -> int:
    device = bench.pick_device(args.device)
    settings = bench.DocmaskSettings(
        preset=args.preset,
        seq_len=args.seq_len,
        batch=args.batch,
        docs=args.docs,
        pairs=args.pairs,
        warmup=args.warmup,
        max_warmup=args.max_warmup,
        dtype=args.dtype or bench.default_dtype(device),
        pe=args.pe,
        backend=args.backend,
        overrides=bench.parse_overrides(args.overrides),
        device=str(device),
        allow_few_pairs=args.allow_few_pairs,
        seed=args.seed,
    )
    return _checked_run(args, settings, bench.check_docmask_settings, bench.run_docmask_benchmark,
                        bench.docmask_report, bench.plot_docmask)


def _bakeoff(args: argparse.Namespace) -> int:
    from tapetrain.bench import bakeoff

    settings = bakeoff.BakeoffSettings(
        groups=args.groups or bakeoff.default_groups(args.head_dims, args.seq_lens),
        dtype=args.dtype or "bf16",
        kv_heads_ratio=args.kv_heads_ratio,
        candidates=args.candidates,
        rounds=args.rounds,
        warmup=args.warmup,
        budget_s=args.budget_s,
        tokens=args.tokens,
        d_model=args.d_model,
        device=args.device,
        seed=args.seed,
    )
    try:
        bakeoff.check_settings(settings)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = bakeoff.run_bakeoff(settings, progress=not args.no_progress)
    print(bakeoff.bakeoff_report(result))
    if args.out:
        print(f"wrote {bench.write_json_atomic(args.out, result)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if args.mode == "data":
        settings = bench.DataSettings(
            workdir=args.workdir,
            corpus_mb=args.corpus_mb,
            vocab=args.vocab,
            reader_tokens=args.reader_tokens,
            seq_lens=args.seq_lens,
            micro_batch=args.micro_batch,
            seconds=args.seconds,
            remote_latency_ms=args.remote_latency_ms,
            tokenizers=args.tokenizers.split(","),
            remote_shard_tokens=args.remote_shard_tokens,
        )
        result = bench.run_data_benchmark(settings)
        print(bench.data_report(result))
        if args.out:
            print(f"wrote {bench.write_json_atomic(args.out, result)}")
        return 0

    if args.mode in ("sp", "cp"):
        return _sp(args)
    if args.mode == "docmask":
        return _docmask(args)
    if args.mode == "bakeoff":
        return _bakeoff(args)
    device = bench.pick_device(getattr(args, "device", "auto"))
    cuda = device.type == "cuda"
    dtype = args.dtype or bench.default_dtype(device)
    progress = not args.no_progress
    if args.mode == "attention":
        settings = bench.AttentionSettings(
            seq_lens=_default("attention", "seq_lens", args.seq_lens, cuda),
            batch=_default("attention", "batch", args.batch, cuda),
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            dtype=dtype,
            warmup=_default("attention", "warmup", args.warmup, cuda),
            iters=_default("attention", "iters", args.iters, cuda),
            backends=args.backends,
            device=str(device),
            seed=args.seed,
        )
        result = bench.run_attention_benchmark(settings, progress)
        _emit(args, result, bench.attention_report(result), bench.plot_attention)
    elif args.mode == "train":
        settings = bench.TrainSettings(
            preset=args.preset,
            seq_len=_seq_len(args, cuda),
            batch=_default("train", "batch", args.batch, cuda),
            steps=_default("train", "steps", args.steps, cuda),
            warmup=_default("train", "warmup", args.warmup, cuda),
            dtype=dtype,
            backend=args.backend,
            activation_checkpointing=args.activation_checkpointing,
            pe_list=args.pe_list,
            float8_list=args.float8_list,
            peak_tflops=args.peak_tflops,
            overrides=bench.parse_overrides(args.overrides),
            device=str(device),
            seed=args.seed,
        )
        try:
            result = bench.run_train_benchmark(settings, progress)
        except ConfigError as error:  # train.float8 this device cannot run: one line, before any work
            print(f"error: {error}", file=sys.stderr)
            return 2
        _emit(args, result, bench.train_report(result), bench.plot_train)
    elif args.mode == "layer":
        settings = bench.LayerSettings(
            preset=args.preset,
            seq_len=args.seq_len or get_preset(args.preset)["max_seq_len"],
            batch=args.batch,
            pe=args.pe,
            dtype=dtype,
            backend=args.backend,
            overrides=bench.parse_overrides(args.overrides),
            device=str(device),
            seed=args.seed,
        )
        result = bench.run_layer_benchmark(settings, progress)
        _emit(args, result, bench.layer_report(result), bench.plot_layer)
    else:
        settings = bench.EngineSettings(
            preset=args.preset,
            seq_len=_seq_len(args, cuda),
            batch=_default("engine", "batch", args.batch, cuda),
            steps=_default("engine", "steps", args.steps, cuda),
            warmup=_default("engine", "warmup", args.warmup, cuda),
            dtype=dtype,
            zero_stage=args.zero_stage,
            pe=args.pe,
            backend=args.backend,
            peak_tflops=args.peak_tflops,
            overrides=bench.parse_overrides(args.overrides),
            seed=args.seed,
        )
        result = bench.run_engine_benchmark(settings, progress)
        _emit(args, result, bench.engine_report(result), bench.plot_engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
