#!/usr/bin/env python
"""Performance benchmarks (README.md "Performance" lists the targets and results); logic lives in tapetrain.bench
(one module per mode).

  python tools/benchmark.py attention [--seq-lens 1024,2048] [--backends sdpa,triton] [--out R.json]
  python tools/benchmark.py train --preset paper-155m --seq-len 1024 [--batch 8] [--pe-list tape,rope] --out R.json
  python tools/benchmark.py engine --preset tiny [--zero-stage 2] --out R.json
  python tools/benchmark.py data [--corpus-mb 8] [--seq-lens 512,2048,8192] [--remote-latency-ms 50] [--out R.json]
  python tools/benchmark.py docmask --preset tiny --seq-len 1024 --docs 8 [--pairs 20] [--pe tape] --out R.json
  python tools/benchmark.py sp --ranks 2 --preset tiny --seq-len 1024 [--pairs 10] [--pe-list tape,rope] --out R.json

Every mode prints a table; with --out it writes JSON (atomically) and a PNG next to it (--plot P.png to move it,
--no-plot to skip). Defaults depend on the device: small sizes and fp32 on CPU, realistic sizes and bf16 on CUDA.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from tapetrain import bench
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


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _common(p: argparse.ArgumentParser, device: bool = True) -> None:
    p.add_argument("--out", type=Path, help="write the results as JSON here (atomically)")
    p.add_argument("--plot", type=Path, help="PNG path (default: --out with .png)")
    p.add_argument("--no-plot", action="store_true", help="do not write a PNG")
    if device:  # engine mode uses the device DeepSpeed's accelerator picks
        p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda[:N]")
    p.add_argument("--dtype", choices=sorted(bench.DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="CPU: torch intra-op threads (1 is steadier on a shared machine)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")


def _rounds_args(p: argparse.ArgumentParser, pairs_help: str) -> None:
    """--pairs and --warmup of the modes that alternate their variants round by round (sp, docmask)."""
    p.add_argument(
        "--pairs",
        type=int,
        default=bench.MIN_HEADLINE_PAIRS,
        help=f"{pairs_help} (default and minimum {bench.MIN_HEADLINE_PAIRS})",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")


def _alternated_args(p: argparse.ArgumentParser, set_help: str) -> None:
    """--set and --allow-few-pairs of the same modes."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=set_help)
    p.add_argument(
        "--allow-few-pairs",
        action="store_true",
        help=f"allow fewer than {bench.MIN_HEADLINE_PAIRS} pairs (tests); the JSON is then no headline",
    )


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", help="model preset: tiny, paper-155m, llama2-7b")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's max_seq_len, ≤128 on CPU)")
    p.add_argument("--batch", type=int, help="sequences per step (default: 2 on CPU, 8 on CUDA)")
    p.add_argument("--steps", type=int, help="timed rounds, each variant once, order rotated (≥ 10 for a headline)")
    p.add_argument("--warmup", type=int, help="untimed optimizer steps first")
    p.add_argument("--backend", default="auto", help="model.attn_backend: auto, eager, sdpa, triton, flash")
    p.add_argument("--peak-tflops", type=float, help="device peak TFLOP/s for MFU (needed on CPU/unknown GPUs)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a model config key, e.g. --set n_layers=24 (repeatable)",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)

    p = sub.add_parser("attention", help="fused-attention micro-benchmark: TAPE vs RoPE per backend")
    _common(p)
    p.add_argument("--seq-lens", type=_ints, help="comma-separated (default: 128,256 on CPU; 1024..8192 on CUDA)")
    p.add_argument("--batch", type=int)
    p.add_argument("--heads", type=int, default=12, help="query heads (default 12, the paper's 155M model)")
    p.add_argument("--kv-heads", type=int, help="key/value heads for GQA (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, help="timed rounds, each case once, order rotated (≥ 10 for a headline)")
    p.add_argument("--warmup", type=int, help="untimed iterations first")
    p.add_argument(
        "--backends", type=_names,
        help=f"only these (comma-separated) of {', '.join(bench.ATTENTION_BACKENDS)}; 'flash' selects all flash",
    )  # fmt: skip

    p = sub.add_parser("train", help="training-step throughput of TAPE and its RoPE twin in one run")
    _common(p)
    _model_args(p)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--pe-list", type=_names, default=["tape", "rope"], help="positional encodings (default tape,rope)")

    p = sub.add_parser("engine", help="DeepSpeed engine (one rank) vs a plain PyTorch loop")
    _common(p, device=False)
    _model_args(p)
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--pe", default="tape", help="positional encoding of the model (default tape)")

    p = sub.add_parser("layer", help="one decoder layer's activation memory, measured vs the memory model")
    _common(p)
    p.add_argument("--preset", default="tiny", help="model preset: tiny, paper-155m, llama-1b, llama2-7b")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's max_seq_len)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--pe", default="tape")
    p.add_argument("--backend", default="auto", help="model.attn_backend")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    p = sub.add_parser("sp", help="sequence parallelism on CPU ranks: SP 1 vs SP N tokens/s and memory per rank")
    _common(p, device=False)  # CPU ranks over gloo
    p.add_argument("--ranks", type=int, default=2, help="ranks to launch; SP 1 is compared with SP = ranks (default 2)")
    p.add_argument("--preset", default="tiny", help="model preset: tiny, paper-155m, ...")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    _rounds_args(p, "timed rounds, each one pair per PE")
    p.add_argument("--pe-list", type=_names, default=["tape", "rope"], help="positional encodings (default tape,rope)")
    p.add_argument("--backend", default="auto", help="model.attn_backend: auto, eager, sdpa")
    _alternated_args(p, "override a model config key, e.g. --set n_layers=4 (repeatable)")

    p = sub.add_parser("docmask", help="training step with vs without the document mask, alternated in one process")
    _common(p)
    p.add_argument("--preset", default="tiny", help="model preset: tiny, paper-155m, ...")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--docs", type=int, default=8, help="documents per row, random lengths (default 8)")
    _rounds_args(p, "timed rounds of one step per variant")
    p.add_argument("--max-warmup", type=int, default=bench.MAX_WARMUP_ROUNDS,
                   help="warm-up goes past --warmup until the mask / no-mask ratio is steady (the last 3 rounds within "
                        f"5%% of their median), at most this many rounds (default {bench.MAX_WARMUP_ROUNDS})")
    p.add_argument("--pe", default="tape", help="positional encoding (default tape)")
    p.add_argument("--backend", default="auto", help="model.attn_backend: auto, eager, sdpa, ...")
    _alternated_args(p, "override a model config key (repeatable)")

    p = sub.add_parser("data", help="prepare throughput (1 and 2 workers) and batch reader throughput")
    p.add_argument("--out", type=Path, help="write the results as JSON here (atomically)")
    p.add_argument("--workdir", help="keep the generated data here (default: a temp dir, removed)")
    p.add_argument("--corpus-mb", type=float, default=8.0, help="synthetic JSONL corpus size in MB")
    p.add_argument("--vocab", type=int, default=4096, help="tokenizer vocabulary size")
    p.add_argument("--reader-tokens", type=int, default=64 << 20, help="tokens of the synthetic reader dataset")
    p.add_argument("--seq-lens", type=_ints, default=[512, 2048, 8192], help="reader sequence lengths")
    p.add_argument("--micro-batch", type=int, default=8, help="reader samples per batch")
    p.add_argument("--seconds", type=float, default=4.0, help="reader time per sequence length")
    p.add_argument("--remote-latency-ms", type=float, default=None,
                   help="also read the dataset over HTTP on 127.0.0.1 with this latency per request (e.g. 50): "
                        "cold and warm shard cache")
    p.add_argument("--remote-shard-tokens", type=int, default=1 << 20, help="tokens per shard of the remote dataset")
    p.add_argument("--tokenizers", default="sentencepiece",
                   help="prepare with these, comma-separated: sentencepiece (a BPE .model), bpe (a byte-level BPE "
                        "tokenizer.json, as Llama-3 / Qwen ship); both are trained on the corpus with --vocab ids")
    return parser


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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

    if args.mode == "sp":
        return _sp(args)
    if args.mode == "docmask":
        return _docmask(args)
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
            peak_tflops=args.peak_tflops,
            overrides=bench.parse_overrides(args.overrides),
            device=str(device),
            seed=args.seed,
        )
        result = bench.run_train_benchmark(settings, progress)
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
