"""`tapetrain data ...`: tokenizer, token shards, shard checks and the task datasets; each prints what it wrote.

Signatures and docstrings are the command-line options and their help (tapetrain.cli_parser)."""

from __future__ import annotations

import json

from tapetrain.data.scrolls import ScrollsTask


def tokenizer(input: list[str], vocab_size: int, out: str, text_key: str = "text") -> None:
    """Train a BPE sentencepiece tokenizer (byte fallback, Llama's special ids) on a corpus.

    Args:
        input: the corpus: .jsonl/.json/.txt globs (also .gz, e.g. C4's c4-*.json.gz; .jsonl.zst),
            .parquet, or hf:NAME[:CONFIG][:SPLIT]
        vocab_size: vocabulary size; must equal the model's model.vocab_size (e.g. 512 for the tiny preset)
        out: the tokenizer file to write (a sentencepiece .model)
        text_key: JSON field that holds each document's text
    """
    from tapetrain.data.tokenizer import Tokenizer, train_tokenizer

    path = train_tokenizer(input, vocab_size, out, text_key=text_key)
    tok = Tokenizer(path)
    print(f"wrote {path} (vocab_size={tok.vocab_size}, sha256={tok.checksum})")


def prepare(input: list[str], tokenizer: str, out: str, text_key: str = "text", val_fraction: float = 0.0,
            workers: int = 1, skip_bad: bool = False, overwrite: bool = False,
            split_docs_at: int | None = None, eos_token: str | None = None) -> None:
    """Tokenize a corpus into token shards + manifest.json (the input of `tapetrain train`).

    Args:
        input: the corpus: .jsonl/.json/.txt globs (also .gz, e.g. C4's c4-*.json.gz; .jsonl.zst),
            .parquet, or hf:NAME[:CONFIG][:SPLIT]
        tokenizer: tokenizer to encode with: a sentencepiece .model (`tapetrain data tokenizer` writes one), a
            Hugging Face tokenizer.json, or a model directory holding either
        out: output directory (written atomically: a crash leaves no half dataset), or a URL in object storage
            (s3://, gs://, hf://): written locally, uploaded (manifest last) and verified
        text_key: JSON field that holds each document's text
        val_fraction: share of documents held out as the val split (0 = no val split)
        workers: tokenizer processes (about one per free CPU core)
        skip_bad: count and skip bad records, do not fail
        overwrite: replace a finished or interrupted run
        split_docs_at: cut every document into pieces of at most this many tokens, each a document (own EOS,
            own train/val draw); for inputs of a few large documents (a .txt file is one document)
        eos_token: the end-of-text token of a bare tokenizer.json (one whose directory has no
            tokenizer_config.json naming its eos_token, as the `tokenizers` library trains it), e.g. '<|endoftext|>';
            the dataset's tokenizer/ copy then names it, and runs on the dataset adopt that copy
    """
    from tapetrain.data.prepare import prepare as prepare_shards

    manifest = prepare_shards(input, tokenizer, out, text_key=text_key, val_fraction=val_fraction, workers=workers,
                              skip_bad=skip_bad, overwrite=overwrite, split_docs_at=split_docs_at,
                              eos_token=eos_token)
    splits = ", ".join(f"{name}: {s['num_tokens']} tokens, {s['num_documents']} docs, {len(s['shards'])} shards"
                       for name, s in manifest["splits"].items())
    print(f"wrote {out}: {splits}; skipped {manifest['skipped_records']} bad records")


def _summary(manifest: dict, out: str) -> str:
    split = manifest["splits"]["train"]
    return (f"wrote {out}: {split['num_examples']} training examples, {split['num_tokens']} tokens "
            f"({split['answer_tokens']} answer tokens), longest {split['max_length']} tokens")


def arith(out: str, max_digits: int = 20, eval_max_digits: int = 40, train_examples: int = 20_000_000,
          eval_per_cell: int = 100, seed: int = 42, overwrite: bool = False) -> None:
    """Addition length-generalisation data (the TAPE paper's arithmetic task).

    Addition problems with reversed digits: training examples with bucket sampling (operand lengths uniform over
    [1, max]²) and an evaluation grid of every (len_a, len_b) up to --eval-max-digits, disjoint from training;
    and the character tokenizer.

    Args:
        out: output directory
        max_digits: longest training operand
        eval_max_digits: grid size of the evaluation
        train_examples: training examples
        eval_per_cell: evaluation problems per grid cell
        seed: seed of the sampled problems
        overwrite: replace OUT if it exists
    """
    from tapetrain.data.arith import write_arith_data

    manifest = write_arith_data(out, max_digits=max_digits, eval_max_digits=eval_max_digits,
                                train_examples=train_examples, eval_per_cell=eval_per_cell, seed=seed,
                                overwrite=overwrite)
    task = manifest["task"]
    print(_summary(manifest, out) + f"; {task['eval_problems']} evaluation problems on a {task['eval_max_digits']}x"
          f"{task['eval_max_digits']} grid; {task['dropped_eval_overlaps']} training candidates rejected as "
          "evaluation problems")


def scrolls(task: ScrollsTask, input: list[str], tokenizer: str, out: str, seq_len: int = 8192,
            max_answer_tokens: int | None = None, overwrite: bool = False, eos_token: str | None = None) -> None:
    """SCROLLS fine-tuning data: records -> supervised examples (loss on the answer only).

    Builds fine-tuning examples from SCROLLS records (id, pid, input, output; jsonl or parquet, or
    hf:tau/scrolls:NAME[:SPLIT]) with the TAPE paper's prompt formats and truncation.

    Args:
        task: the SCROLLS task (sets the prompt format and the answer budget)
        input: .jsonl/.json/.parquet files (globs) or hf:tau/scrolls:NAME[:SPLIT] (split default train)
        tokenizer: tokenizer of the model to tune (a sentencepiece .model, a tokenizer.json or a model directory)
        out: output directory
        seq_len: tokens per example, prompt + answer + EOS
        max_answer_tokens: answer budget (default: 200 for QA tasks, 1000 for summaries)
        overwrite: replace OUT if it exists
        eos_token: the end-of-text token of a bare tokenizer.json (no tokenizer_config.json naming its eos_token),
            e.g. '<|endoftext|>'; the store's copy of the tokenizer then names it
    """
    from tapetrain.data.scrolls import write_scrolls_data

    manifest = write_scrolls_data(task, input, tokenizer, out, seq_len=seq_len, max_answer_tokens=max_answer_tokens,
                                  overwrite=overwrite, eos_token=eos_token)
    info = manifest["task"]
    print(_summary(manifest, out) + f"; {info['records']} records of {info['ids']} ids; prompts truncated in "
          f"{info['truncated_prompts']}, answers in {info['truncated_answers']}")
    print(json.dumps({"prompt_format": info["prompt_format"]}))
