"""SCROLLS (Shaham et al. 2022) records -> fine-tuning examples, with the prompt formats and truncation of the
TAPE paper's official code.

Records are SCROLLS' own: {"id", "pid", "input", "output"}, one per (example, reference): an id with several
references appears once per reference (each becomes a training example; evaluation groups them by id). Read from
.jsonl / .json / .parquet files or streamed as hf:tau/scrolls:NAME[:SPLIT].

An example of `seq_len` tokens at most (8192 in the paper) is
  QA tasks (qasper, narrative_qa, quality, contract_nli):
      prompt  = <s> input                       (truncated to seq_len - max_answer - 1 tokens, the end cut off;
                                                 SCROLLS puts the question before the document, so it survives)
      answer  = output[:max_answer tokens] </s>                        max_answer = 200
  Summaries (gov_report, summ_screen_fd, qmsum):
      prompt  = <s> "Context:\\n" + input + "\\n Please summarize this report:"
                (when too long: its head, then its last T tokens, the instruction: 7184 + 7 with Llama-2's tokenizer)
      answer  = output[:max_answer tokens] </s>                        max_answer = 1000
The loss is on the answer and its EOS only. Three deliberate differences from the official code: the answer does
not start with a second <s> (the official code tokenized it with one); a summary prompt that fits is kept whole
(the official code always appended the last 7 tokens to the first 7184, repeating the instruction of a short
document); and nothing is padded here (the training reader pads each example to data.seq_len).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from tapetrain.data.errors import DataError
from tapetrain.data.examples import TOKENIZER_FILE, ExampleWriter, example_dir_writer, write_manifest
from tapetrain.data.sources import expand_inputs, parse_hf_spec
from tapetrain.progress import progress as progress_bar

log = logging.getLogger(__name__)

QA_TASKS = ("qasper", "narrative_qa", "quality", "contract_nli")
SUMMARY_TASKS = ("gov_report", "summ_screen_fd", "qmsum")
TASKS = {**dict.fromkeys(QA_TASKS, "qa"), **dict.fromkeys(SUMMARY_TASKS, "summary")}
ScrollsTask = Literal["qasper", "narrative_qa", "quality", "contract_nli", "gov_report", "summ_screen_fd", "qmsum"]
MAX_ANSWER_TOKENS = {"qa": 200, "summary": 1000}
SUMMARY_PREFIX = "Context:\n"
SUMMARY_SUFFIX = "\n Please summarize this report:"
# The official code cuts QA inputs to their first 20000 (training) or 15000 (evaluation) space-separated words
# before tokenizing; that is far beyond the token budget, so it only saves tokenizer time. We keep the larger cap.
MAX_INPUT_WORDS = 20000


@dataclass
class Record:
    id: str
    pid: str
    input: str
    output: str | None
    where: str  # file:line or hf spec:row, for messages


def _record(raw: object, where: str) -> Record:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected a SCROLLS record (a JSON object with id, pid, input, output), got "
                        f"{type(raw).__name__}")
    missing = [k for k in ("id", "input") if k not in raw]
    if missing:
        raise DataError(f"{where}: record lacks {', '.join(missing)} (keys: {', '.join(sorted(map(str, raw)))}); "
                        "SCROLLS records have id, pid, input and output")
    if not isinstance(raw["input"], str) or not isinstance(raw["id"], str):
        raise DataError(f"{where}: 'id' and 'input' must be strings")
    output = raw.get("output")
    if output is not None and not isinstance(output, str):
        raise DataError(f"{where}: 'output' must be a string or null, got {type(output).__name__}")
    return Record(raw["id"], str(raw.get("pid", raw["id"])), raw["input"], output, where)


def iter_records(inputs: str | list[str]) -> Iterator[Record]:
    """Every record of the inputs in order (files sorted per glob, as `tapetrain data prepare`)."""
    for source in expand_inputs(inputs):
        if source.startswith("hf:"):
            yield from _hf_records(source)
        elif source.endswith(".parquet"):
            yield from _parquet_records(source)
        elif source.endswith((".jsonl", ".json")):
            yield from _json_records(source)
        else:
            raise DataError(f"{source}: SCROLLS records are read from .jsonl, .json or .parquet files (or hf:...)")


def _json_records(path: str) -> Iterator[Record]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        for i, raw in enumerate(json.loads(text), start=1):
            yield _record(raw, f"{path}:item {i}")
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: malformed JSON ({err.msg}); fix the line") from err
            yield _record(raw, f"{path}:{lineno}")


def _parquet_records(path: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for row, raw in enumerate(table.to_pylist(), start=1):
        yield _record(raw, f"{path}:row {row}")


def _hf_records(spec: str) -> Iterator[Record]:
    import datasets

    name, config, split = parse_hf_spec(spec)
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as err:  # datasets raises many kinds (network, missing config, ...)
        raise DataError(f"cannot load {spec} ({type(err).__name__}: {err}); check NAME:CONFIG:SPLIT (e.g. "
                        "hf:tau/scrolls:qasper:train) and network access, or download the files and pass them") from err
    for row, raw in enumerate(ds, start=1):
        yield _record(dict(raw), f"{spec}:row {row}")


def references_by_id(records: list[Record]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """({id: input}, {id: [outputs]}) in first-seen order: SCROLLS' one-row-per-reference layout grouped by id."""
    inputs: dict[str, str] = {}
    refs: dict[str, list[str]] = {}
    for r in records:
        if r.output is None:
            raise DataError(f"{r.where}: record {r.id!r} has no output (SCROLLS' test split is unlabelled); use the "
                            "train or validation split")
        inputs.setdefault(r.id, r.input)
        refs.setdefault(r.id, []).append(r.output)
    return inputs, refs


class PromptBuilder:
    """Token ids of prompts and answers for one task, tokenizer and sequence budget (see the module docstring)."""

    def __init__(self, task: str, tokenizer, seq_len: int = 8192, max_answer_tokens: int | None = None):
        if task not in TASKS:
            raise DataError(f"unknown SCROLLS task {task!r}; choose one of {', '.join(sorted(TASKS))}")
        self.task, self.kind, self.tok = task, TASKS[task], tokenizer
        self.max_answer = max_answer_tokens or MAX_ANSWER_TOKENS[self.kind]
        self.prompt_budget = seq_len - self.max_answer - 1
        if self.prompt_budget < 16:
            raise DataError(f"--seq-len {seq_len} leaves {self.prompt_budget} prompt tokens after a {self.max_answer}-"
                            "token answer and EOS; raise --seq-len or lower --max-answer-tokens")
        if tokenizer.eos_id < 0:
            raise DataError(f"tokenizer {tokenizer.path} has no EOS id; examples end their answer with EOS: name "
                            "the tokenizer's end-of-text token with --eos-token (e.g. --eos-token '<|endoftext|>')")
        self.bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
        # The instruction's tokens at the end of a summary prompt: measured in context, after a stand-in input.
        stub = tokenizer.encode(SUMMARY_PREFIX + "x")
        self.instruction_tokens = len(tokenizer.encode(SUMMARY_PREFIX + "x" + SUMMARY_SUFFIX)) - len(stub)

    def prompt(self, text: str) -> tuple[list[int], bool]:
        """(prompt ids, whether they were truncated)."""
        if self.kind == "qa":
            ids = self.bos + self.tok.encode(" ".join(text.split(" ")[:MAX_INPUT_WORDS]))
            return ids[:self.prompt_budget], len(ids) > self.prompt_budget
        ids = self.bos + self.tok.encode(SUMMARY_PREFIX + text + SUMMARY_SUFFIX)
        if len(ids) <= self.prompt_budget:
            return ids, False
        tail = self.instruction_tokens
        return ids[:self.prompt_budget - tail] + ids[-tail:], True

    def answer(self, text: str) -> tuple[list[int], bool]:
        """(answer ids ending with EOS, whether the answer was truncated)."""
        ids = self.tok.encode(text)
        return ids[:self.max_answer] + [self.tok.eos_id], len(ids) > self.max_answer

    def describe(self) -> str:
        if self.kind == "qa":
            return (f"<s> input[:{self.prompt_budget} tokens incl. <s>] + output[:{self.max_answer} tokens] </s>")
        return (f"<s> 'Context:\\n' + input + '\\n Please summarize this report:' (head + last "
                f"{self.instruction_tokens} tokens when over {self.prompt_budget}) + output[:{self.max_answer} tokens]"
                " </s>")


def write_scrolls_data(task: str, inputs: str | list[str], tokenizer_path: str, out_dir: str, seq_len: int = 8192,
                       max_answer_tokens: int | None = None, overwrite: bool = False, progress: bool = True,
                       eos_token: str | None = None) -> dict:
    """`tapetrain data scrolls`: one training example per record, in an example store with a copy of the tokenizer."""
    from tapetrain.data.tokenizer import open_tokenizer, write_copy

    tok = open_tokenizer(tokenizer_path, eos_token)
    builder = PromptBuilder(task, tok, seq_len, max_answer_tokens)
    sources = expand_inputs(inputs)  # bad globs fail before anything is written
    start = time.perf_counter()
    ids: set[str] = set()
    truncated_prompts = truncated_answers = 0
    with example_dir_writer(out_dir, overwrite) as tmp:
        writer = ExampleWriter(tmp, "train", tok.vocab_size)
        bar = progress_bar(desc=f"data scrolls {task}", unit="record", disable=not progress)
        with bar:
            for record in iter_records(sources):
                if record.output is None:
                    raise DataError(f"{record.where}: record {record.id!r} has no output (SCROLLS' test split is "
                                    "unlabelled); build training data from the train split")
                prompt, cut_prompt = builder.prompt(record.input)
                answer, cut_answer = builder.answer(record.output)
                writer.add(prompt, answer)
                ids.add(record.id)
                truncated_prompts += cut_prompt
                truncated_answers += cut_answer
                bar.update(1)
                bar.set_postfix_str(f"{writer.num_tokens / (time.perf_counter() - start) / 1e3:.0f}k tok/s",
                                    refresh=False)
        split = writer.close()
        # the store keeps its tokenizer: a .model as tokenizer.model, a tokenizer.json with its config files (or
        # the one that names the EOS given with --eos-token)
        if tok.kind == "sentencepiece":
            kept = shutil.copyfile(tok.path, os.path.join(tmp, TOKENIZER_FILE))
        else:
            kept = write_copy(tok, tmp)
        info = {
            "name": "scrolls",
            "scrolls_task": task,
            "kind": builder.kind,
            "seq_len": seq_len,
            "max_answer_tokens": builder.max_answer,
            "prompt_budget": builder.prompt_budget,
            "prompt_format": builder.describe(),
            "inputs": sources,
            "records": split["num_examples"],
            "ids": len(ids),
            "truncated_prompts": truncated_prompts,
            "truncated_answers": truncated_answers,
            "mean_length": round(split["num_tokens"] / split["num_examples"], 1),
        }
        manifest = write_manifest(tmp, vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id,
                                  pad_id=tok.pad_id, splits={"train": split}, task=info,
                                  tokenizer_source=tok.path, tokenizer_file=os.path.basename(kept))
    log.info("data scrolls %s: %d records (%d ids), %d prompts and %d answers truncated, %.1fs", task,
             split["num_examples"], len(ids), truncated_prompts, truncated_answers, time.perf_counter() - start)
    return manifest

