"""Subcommands export-hf, eval-ppl and eval-passkey (README.md has the recipes). Each `add_*_parser(subparsers)`
registers one; `configure_*(parser)` fills a plain ArgumentParser (the tools/ scripts). `func(args) -> int` runs
the job."""

from __future__ import annotations

import argparse


def add_step_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--step", type=int, default=None, help="run directories: checkpoint step (default newest)")


def accept_launcher_rank(parser: argparse.ArgumentParser) -> None:
    """The deepspeed launcher passes --local_rank; rank and world size come from the environment."""
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--lengths {text!r}: expected comma-separated integers, e.g. "
                                         "1024,2048,4096") from err
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"--lengths {text!r}: give positive integers, e.g. 1024,2048")
    return lengths


# ---- export-hf ---------------------------------------------------------------------------------------------------


def export_summary(run_dir: str, result: dict) -> str:
    """Two lines for the console; the full result is OUT/tapetrain_export.json."""
    check = result.get("verification")
    verified = (f"verified: max |Δlogits| {check['max_abs_diff']:.2g} <= {check['tolerance']:.2g}" if check
                else "not verified (--no-verify)")
    load = "AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)" if result["remote_code"] else \
        "AutoModelForCausalLM.from_pretrained(OUT)"
    return (f"exported {run_dir} step {result['step']} to {result['out_dir']}: {result['architecture']} pe="
            f"{result['pe']} {result['dtype']}, tokenizer {result['tokenizer']['status']}; {verified}\n"
            f"load with {load}; details in {result['out_dir']}/tapetrain_export.json")


def configure_export_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (or one checkpoint directory in it)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest complete one)")
    parser.add_argument("--out", required=True, metavar="HF_DIR", help="output directory (written atomically)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="weight dtype")
    parser.add_argument("--tokenizer", default=None, help="sentencepiece .model (default: the run's data.tokenizer)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 500MB")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip reloading the export with transformers and comparing logits")
    parser.add_argument("--overwrite", action="store_true", help="replace HF_DIR if it exists")

    def run(args: argparse.Namespace) -> int:
        from tapetrain.checkpoint.hf_export import export_hf

        result = export_hf(args.run_dir, args.out, args.step, args.dtype, args.verify, args.tokenizer,
                           max_shard_size=args.max_shard_size, overwrite=args.overwrite)
        print(export_summary(args.run_dir, result))
        return 0

    parser.set_defaults(func=run)
    return parser


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("export-hf", help="export a checkpoint to Hugging Face format (verified)",
                                   description="Export a run's checkpoint to a Hugging Face model directory: "
                                   "LlamaForCausalLM for RoPE, remote code (trust_remote_code) otherwise.")
    return configure_export_parser(parser)


# ---- eval-ppl ----------------------------------------------------------------------------------------------------


def configure_eval_ppl_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", metavar="MODEL", help="Hugging Face export directory or run directory")
    parser.add_argument("--data", required=True, help="flat uint16 .bin (LongLoRA), prepared shard dir, or text")
    parser.add_argument("--lengths", type=parse_lengths, default=None, help="context lengths (default 1024,...,8192)")
    parser.add_argument(
        "--protocol", choices=("nonoverlap", "sliding", "longlora", "longlora-eval"), default=None,
        help="nonoverlap (default: each target once); sliding (needs --stride); longlora = the TAPE paper's PPL "
        "table: LongLoRA's eval_distributed.py and the TAPE repository's eval_llama.py (starts range(0, N-L, 256), "
        "all L-1 predictions of each window scored, token-weighted); longlora-eval = LongLoRA's eval.py (the same "
        "starts minus the last, mean of per-batch mean losses, 2.71828**loss)")
    parser.add_argument("--stride", type=int, default=None, help="sliding protocol: tokens between window starts")
    parser.add_argument("--reference-ranks", type=int, default=1, metavar="R",
                        help="longlora: the GPUs the reference ran on; DistributedSampler then repeats windows to a "
                        "multiple of R (default 1: no repeats)")
    parser.add_argument("--reference-batch-size", type=int, default=None, metavar="B",
                        help="longlora-eval: windows per averaged batch, eval.py's --batch_size (default 32)")
    parser.add_argument("--split", choices=("val", "train"), default=None,
                        help="shard directories: split to evaluate (default val; without a val split, --split train "
                        "must be given)")
    parser.add_argument("--out", default=None, help="result JSON")
    parser.add_argument("--plot", default=None, help="PNG of PPL vs length (with any --compare results)")
    parser.add_argument("--compare", nargs="+", default=None, metavar="R.json", help="earlier results to plot too")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="compute dtype (the references ran fp16)")
    parser.add_argument("--max-tokens", type=int, default=None, help="evaluate the first N tokens of the data only")
    parser.add_argument("--batch-size", type=int, default=1, help="windows per forward pass")
    parser.add_argument("--tokenizer", default=None, help="sentencepiece .model for text data (default: the model's)")
    parser.add_argument("--token-dtype", choices=("uint16", "uint32"), default=None,
                        help=".bin id width (default uint16)")
    add_step_argument(parser)
    accept_launcher_rank(parser)

    def run(args: argparse.Namespace) -> int:
        from tapetrain.eval.ppl import run_eval_ppl

        run_eval_ppl(args.model, args.data, args.lengths, protocol=args.protocol, stride=args.stride,
                     dtype=args.dtype, max_tokens=args.max_tokens, batch_size=args.batch_size,
                     tokenizer=args.tokenizer, token_dtype=args.token_dtype, step=args.step, out=args.out,
                     plot=args.plot, compare=args.compare, split=args.split, reference_ranks=args.reference_ranks,
                     reference_batch_size=args.reference_batch_size)
        return 0

    parser.set_defaults(func=run)
    return parser


def add_eval_ppl_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("eval-ppl", help="perplexity across context lengths",
                                   description="Token-weighted perplexity at each context length; runs on several "
                                   "ranks under torchrun/deepspeed.")
    return configure_eval_ppl_parser(parser)


# ---- eval-passkey ------------------------------------------------------------------------------------------------


def configure_eval_passkey_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", metavar="MODEL", help="Hugging Face export directory or run directory")
    parser.add_argument(
        "--protocol", choices=("tape", "longlora", "tapetrain"), default="tape",
        help="tape (default) = the TAPE repository's eval_retrieval.py, the TAPE paper's passkey figure (20 trials, "
        "--max-tokens 8192); longlora = LongLoRA's passkey_retrivial.py (10 trials, --max-tokens 32000); both: "
        "filler of int(3.75*i*interval//1024*1024) characters at length point i, seeds 0..trials-1, token match. "
        "tapetrain = ours (target token --lengths, key on sentence boundaries; not comparable with the papers)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tape/longlora: the scripts' --max_tokens (length points = max_tokens // interval)")
    parser.add_argument("--interval", type=int, default=None, help="tape/longlora: the scripts' --interval (1000)")
    parser.add_argument("--lengths", type=parse_lengths, default=None,
                        help="tapetrain protocol: prompt lengths in tokens (default 1024,...,8192)")
    parser.add_argument("--trials", type=int, default=None,
                        help="trials per length (default: 20 for tape and tapetrain, 10 for longlora)")
    parser.add_argument("--seed", type=int, default=None, help="tapetrain protocol: seed of keys and positions (0)")
    parser.add_argument("--tokenizer", default=None, help="sentencepiece .model (default: the model's)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="compute dtype (the references ran fp16)")
    parser.add_argument("--out", default=None, help="result JSON")
    parser.add_argument("--plot", default=None, help="PNG of accuracy vs length")
    add_step_argument(parser)

    def run(args: argparse.Namespace) -> int:
        from tapetrain.eval.passkey import run_eval_passkey

        run_eval_passkey(args.model, args.lengths, protocol=args.protocol, trials=args.trials, seed=args.seed,
                         max_tokens=args.max_tokens, interval=args.interval, tokenizer=args.tokenizer,
                         dtype=args.dtype, step=args.step, out=args.out, plot=args.plot)
        return 0

    parser.set_defaults(func=run)
    return parser


def add_eval_passkey_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("eval-passkey", help="passkey retrieval across context lengths",
                                   description="Hide a pass key in filler text and ask for it (the TAPE "
                                   "repository's or LongLoRA's protocol, or ours).")
    return configure_eval_passkey_parser(parser)
