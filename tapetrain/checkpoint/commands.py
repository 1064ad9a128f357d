"""`tapetrain export hf`: the signature and docstring are the command-line options and help (tapetrain.cli_parser)."""

from __future__ import annotations

import sys
from typing import Literal


def export_summary(run_dir: str, result: dict) -> str:
    """Two lines for the console; the full result is OUT/tapetrain_export.json."""
    check = result.get("verification")
    verified = (f"verified: max |Δlogits| {check['max_abs_diff']:.2g} <= {check['tolerance']:.2g}" if check
                else "not verified (--no-verify)")
    # A remote-code export's AutoTokenizer reads config.json (its auto_map) as well: without trust_remote_code it
    # asks "[y/N]" although the tokenizer class itself is transformers' own.
    trust = ", trust_remote_code=True" if result["remote_code"] else ""
    load = f"AutoModelForCausalLM.from_pretrained(OUT{trust})"
    if result["tokenizer"]["status"] != "none":
        load += f" and AutoTokenizer.from_pretrained(OUT{trust})"
    return (f"exported {run_dir} step {result['step']} to {result['out_dir']}: {result['architecture']} pe="
            f"{result['pe']} {result['dtype']}, tokenizer {result['tokenizer']['status']}; {verified}\n"
            f"load with {load}; details in {result['out_dir']}/tapetrain_export.json")


def export_hf(run_dir: str, out: str, step: int | None = None, dtype: Literal["fp32", "bf16", "fp16"] = "fp32",
              tokenizer: str | None = None, max_shard_size: str = "5GB", verify: bool = True,
              overwrite: bool = False) -> None:
    """Export a checkpoint to Hugging Face format (verified against tapetrain's logits).

    LlamaForCausalLM for RoPE models, remote code (trust_remote_code=True) otherwise; LoRA weights are merged.

    Args:
        run_dir: run directory (or one checkpoint directory in it)
        out: output directory (written atomically)
        step: checkpoint step (default: newest complete one)
        dtype: weight dtype
        tokenizer: a sentencepiece .model, a tokenizer.json or a model directory (default: the run's
            data.tokenizer)
        max_shard_size: largest safetensors shard, e.g. 5GB or 500MB
        verify: reload the export with transformers and compare logits (--no-verify skips it)
        overwrite: replace OUT if it holds an earlier export
    """
    from tapetrain.checkpoint.hf_export import export_hf as export

    result = export(run_dir, out, step, dtype, verify, tokenizer, max_shard_size=max_shard_size, overwrite=overwrite)
    print(export_summary(run_dir, result))


def verify(data_dirs: list[str], quiet: bool = False) -> int:
    """Check every shard's sha256 and token ids, or every checkpoint's files, against their manifests (exit 1 on
    any mismatch).

    Args:
        data_dirs: directories written by `tapetrain data prepare` (or data arith / data scrolls), or their URLs
            in object storage (streamed, not stored), run directories (every checkpoint) or checkpoint directories
        quiet: no progress output
    """
    # Here, not in data/commands.py: a run directory's checkpoints are checkpoint business, and data sits below
    # checkpoint (tests/unit/test_layering.py).
    from pathlib import Path

    from tapetrain.checkpoint import manifest
    from tapetrain.data.verify import verify_dataset
    from tapetrain.errors import DataError

    bad = 0
    for path in data_dirs:
        notes: list[str] = []
        try:
            if manifest.is_run_or_checkpoint(Path(path)):
                problems, notes = manifest.verify_checkpoints(Path(path))
            else:
                problems = verify_dataset(path, progress=not quiet)
        except DataError as err:
            problems = [str(err)]
        for note in notes:
            print(f"{path}: {note}", file=sys.stderr)
        for problem in problems:
            print(f"{path}: {problem}", file=sys.stderr)
        print(f"{path}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        bad += bool(problems)
    return 1 if bad else 0
